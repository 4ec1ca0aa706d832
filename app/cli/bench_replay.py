"""`specchat bench --replay`: the same seed gives the same reply whatever the drafter, γ, settings and --samples.

Runs ``backend/bench/replay.py``'s grid on one local pair: the suite's prompts (``--suite``, ``--limit`` per
family; the first turn of each, rendered with the pair's chat template) × the grid's sampling settings × seeds
``--seed``, ``--seed + samples``, ... (``--seeds`` blocks of ``--samples`` consecutive seeds) × every drafter the
pair has and γ 1, 4, 16, auto (``--drafters``, ``--gammas`` narrow it). Prints one line per difference found
(with the position and both runs' rows there), a summary, and writes ``replay.json`` to ``--out``. Returns 0 when
every run equalled plain decoding, 1 otherwise.

Contract: :func:`add_options` adds the replay options to the bench parser; :func:`run` takes its namespace.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

DEFAULT_SAMPLES = 2
DEFAULT_REPLAY_LIMIT = 1  # prompts per family
DEFAULT_REPLAY_TOKENS = 48


def add_options(parser: argparse.ArgumentParser, positive_int: Any) -> None:
    """The options only ``--replay`` reads (the bench's own --pair, --suite, --limit, --seed, --max-new-tokens and
    --out apply too)."""
    group = parser.add_argument_group("replay (--replay)")
    group.add_argument(
        "--replay",
        action="store_true",
        help="check that every drafter, γ, setting and --samples give plain decoding's reply for each seed",
    )
    group.add_argument(
        "--samples",
        type=positive_int,
        default=DEFAULT_SAMPLES,
        metavar="N",
        help=f"consecutive seeds per block, decoded as `generate --samples` does (default: {DEFAULT_SAMPLES})",
    )
    group.add_argument(
        "--seeds", type=positive_int, default=1, metavar="N", help="blocks of seeds per prompt and setting (default: 1)"
    )
    group.add_argument("--drafters", nargs="+", default=None, metavar="NAME", help="drafters to check (default: all)")
    group.add_argument(
        "--gammas",
        nargs="+",
        default=None,
        metavar="G",
        help="γ values to check: whole numbers or auto (default: 1 4 16 auto)",
    )
    group.add_argument(
        "--settings",
        nargs="+",
        type=int,
        default=None,
        metavar="I",
        help="indices into the grid's sampling settings (default: all; `--settings -1` lists them)",
    )


def _gammas(values: list[str] | None) -> tuple[Any, ...]:
    from specchat.backend.bench.replay import GAMMAS
    from specchat.backend.errors import RequestError
    from specchat.backend.limits import is_gamma

    if values is None:
        return GAMMAS
    out: list[Any] = []
    for value in values:
        gamma: Any = value if value == "auto" else (int(value) if value.isdigit() else value)
        if not is_gamma(gamma):
            raise RequestError(f"--gammas {value!r}: use whole numbers 1 .. the largest γ, or auto")
        out.append(gamma)
    return tuple(out)


def _settings(indices: list[int] | None) -> tuple[Any, ...] | None:
    """The chosen settings; None after listing them (``--settings -1``)."""
    from specchat.backend.bench.replay import SETTINGS
    from specchat.backend.errors import RequestError

    if indices is None:
        return SETTINGS
    if indices == [-1]:
        for i, setting in enumerate(SETTINGS):
            print(f"{i:2d}  {setting.label()}")
        return None
    bad = [i for i in indices if not 0 <= i < len(SETTINGS)]
    if bad:
        raise RequestError(f"--settings {bad[0]}: use 0 .. {len(SETTINGS) - 1} (`--settings -1` lists them)")
    return tuple(SETTINGS[i] for i in indices)


def _source(args: argparse.Namespace) -> str:
    return f"--prompts {args.prompts}" if getattr(args, "prompts", None) else f"--suite {args.suite}"


def run(args: argparse.Namespace) -> int:
    import sys

    from specchat.app.cli.bench_prompts import load_prompts
    from specchat.backend.bench.replay import ReplayPrompt, combinations, count_runs, grid_drafters, replay
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.engine.prompting import render
    from specchat.backend.errors import RequestError
    from specchat.backend.limits import DEFAULT_PAIR, MAX_GAMMA, check_seed_range
    from specchat.backend.models.catalog.config import get_pair, load_pairs

    settings = _settings(args.settings)
    if settings is None:
        return 0
    gammas = _gammas(args.gammas)
    samples, blocks = args.samples, args.seeds
    seeds = [args.seed + j * samples for j in range(blocks)]
    check_seed_range(args.seed, samples * blocks, "--seed")
    max_new = args.max_new_tokens or DEFAULT_REPLAY_TOKENS
    pairs = load_pairs(args.models)
    names = list(args.pair or [DEFAULT_PAIR])
    if len(names) != 1:
        raise RequestError("--replay checks one pair at a time: give one --pair")
    config = get_pair(pairs, names[0])
    if config.remote is not None:
        raise RequestError(f"--replay needs a local pair; {config.name} runs on {config.remote.server}")
    prompts = load_prompts(args, args.limit or DEFAULT_REPLAY_LIMIT)
    print(f"Loading pair {config.name} ...", file=sys.stderr)
    engine = load_engine(config, device=args.device)
    try:
        path = engine.runner.start_line  # one forward path for every run (docs/determinism.md)
        drafters = grid_drafters(engine)
        if args.drafters:
            unknown = [d for d in args.drafters if d not in drafters]
            if unknown:
                raise RequestError(f"--drafters {unknown[0]!r}: {config.name} has {', '.join(drafters)}")
            drafters = list(args.drafters)
        budget = engine.context_length - max_new - MAX_GAMMA - 1  # room for the reply and a verification step
        chosen = [ReplayPrompt(p.id, tuple(render(engine.tokenizer, p.message_dicts()))) for p in prompts]
        chosen = [p for p in chosen if len(p.ids) <= budget]
        if not chosen:
            raise RequestError(
                f"no prompt of {_source(args)} fits {config.name}'s context ({engine.context_length} tokens) "
                f"with {max_new} new tokens; lower --max-new-tokens or choose a pair with a longer context"
            )
        combos = combinations(drafters, gammas)
        runs, refs = count_runs(len(chosen), len(settings), len(seeds), samples, len(combos))
        lengths = ", ".join(str(len(p.ids)) for p in chosen)
        print(
            f"Replay on {config.name} ({path}): {len(chosen)} prompts "
            f"({lengths} tokens) × {len(settings)} settings × {len(seeds)}×{samples} seeds × {len(combos)} "
            f"drafter/γ = {runs} runs against {refs} plain references, {max_new} tokens each",
            file=sys.stderr,
        )
        last = [time.perf_counter()]

        def progress(result: Any) -> None:
            if time.perf_counter() - last[0] > 10:
                last[0] = time.perf_counter()
                print(
                    f"  {result.runs}/{runs} runs, {len(result.differences)} differences, {result.elapsed_s:.0f} s",
                    file=sys.stderr,
                )

        def difference(found: Any) -> None:
            print(found.describe(lambda ids: engine.tokenizer.decode(ids)), flush=True)

        result = replay(
            engine,
            chosen,
            settings=settings,
            seeds=seeds,
            samples=samples,
            gammas=gammas,
            max_new_tokens=max_new,
            drafters=drafters,
            on_run=progress,
            on_difference=difference,
        )
    finally:
        engine.close()
    summary = result.to_dict() | {
        "pair": config.name,
        "path": path,
        "prompts": {p.id: len(p.ids) for p in chosen},
        "settings": [s.label() for s in settings],
        "seeds": seeds,
        "samples": samples,
        "gammas": list(gammas),
        "max_new_tokens": max_new,
    }
    out = Path(args.out or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(
        f"{result.runs} runs ({result.tokens} tokens) against {result.references} plain references: "
        f"{len(result.differences)} differences; by drafter {result.by_drafter}; {result.elapsed_s / 60:.1f} min; "
        f"wrote {out / 'replay.json'}"
    )
    return 0 if not result.differences else 1
