"""`specchat bench --structured`: constrained decoding on the structured family (issue 46).

Runs ``backend/bench/structured.py`` on one local pair: the family's JSON schemas and tool calls (``--limit`` of
them), each in the modes plain (constrained, no drafter), jump-forward, speculative (the pair's drafter) and both,
one after another per prompt, with ``--temperature`` and ``--seed`` (every mode must give the same reply). Prints
the table (validity, tok/s, speed-up over plain constrained decoding, tokens per step, µs per mask, the masks'
share of the decoding time) and writes ``structured.json`` (every reply, per mode) to ``--out``. Returns 0 when every
reply validated and every mode gave the same reply, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_STRUCTURED_TOKENS = 320


def add_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured outputs (--structured)")
    group.add_argument(
        "--structured",
        action="store_true",
        help="JSON schemas and tool calls under their constraint: validity, tok/s with and without speculation "
        "and jump-forward, mask time",
    )


def run(args: argparse.Namespace) -> int:
    from specchat.backend.bench.structured import load_cases, run_structured, table
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.errors import RequestError
    from specchat.backend.limits import DEFAULT_PAIR
    from specchat.backend.models.catalog.config import get_pair, load_pairs

    names = list(args.pair or [DEFAULT_PAIR])
    if len(names) != 1:
        raise RequestError("--structured measures one pair at a time: give one --pair")
    config = get_pair(load_pairs(args.models), names[0])
    if config.remote is not None:
        raise RequestError(f"--structured needs a local pair; {config.name} runs on {config.remote.server}")
    cases = load_cases(limit=args.limit)
    max_new = args.max_new_tokens or DEFAULT_STRUCTURED_TOKENS
    print(f"Loading pair {config.name} ...", file=sys.stderr)
    engine = load_engine(config, device=args.device)
    try:
        path = engine.runner.start_line
        print(f"Structured bench on {config.name} ({path}): {len(cases)} schemas x 4 modes", file=sys.stderr)
        report = run_structured(
            engine,
            cases[:1],  # warm-up: the grammar engine's view of the tokenizer, first passes
            max_new_tokens=16,
            temperature=args.temperature,
            seed=args.seed,
        )
        report = run_structured(
            engine,
            cases,
            max_new_tokens=max_new,
            temperature=args.temperature,
            seed=args.seed,
            progress=lambda line: print("  " + line, file=sys.stderr, flush=True),
        )
    finally:
        engine.close()
    report |= {"pair": config.name, "path": path, "drafter": config.drafter}
    out = Path(args.out or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(table(report))
    print(f"{report['seconds'] / 60:.1f} min; wrote {out / 'structured.json'}")
    every = all(s["validated"] == s["replies"] for s in report["summary"].values())
    return 0 if every and not report["replay_differences"] else 1
