"""`/edit` in SEARCH/REPLACE blocks on the embedded default, with and without the SEARCH constraint (issue 46).

Twenty edit requests over five of specchat's own source files of 3-5 KiB (larger than ``REWRITE_MAX_BYTES``, so
/edit asks for blocks), each sent as the chat UI sends it (``editing.build_edit_prompt``) and decoded with the
pair's settings and a fixed seed, once constrained (``edit_grammar.edit_constraint``: the block syntax enforced,
every SEARCH whole consecutive lines of its file) and once free, in alternating order. Each reply goes through
``edit_plan.plan_edit`` as the UI's dialog does. Per request and mode: the blocks written, how many SEARCH
sections occur in their file, and the outcome (applied, or refused with edit_plan's first reason). Writes
``edit_blocks.json`` to ``--out``.

    python benchmarks/edit_blocks.py [--max-new-tokens 256] [--limit 20] [--out bench_out]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specchat.app.chat.edit_grammar import edit_constraint
from specchat.app.chat.edit_plan import parse_blocks, plan_edit
from specchat.app.chat.editing import build_edit_prompt, load_edit_target
from specchat.backend.api import GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = [
    ("backend/engine/detokenize.py", "rename the class IncrementalDetokenizer to StreamingDetokenizer"),
    ("backend/engine/detokenize.py", "add a comment above REPLACEMENT saying what it is"),
    ("backend/engine/detokenize.py", "make flush() return an empty string when nothing is held back"),
    ("backend/engine/detokenize.py", "add type hints to every method that lacks them"),
    ("backend/engine/parts.py", "rename describe_error to error_text"),
    ("backend/engine/parts.py", "add a docstring to is_out_of_memory"),
    ("backend/engine/parts.py", "make Target's eos_ids a tuple instead of a frozenset"),
    ("backend/engine/parts.py", "remove the class Speculation"),
    ("backend/speculative/gumbel.py", "rename mix64 to mix"),
    ("backend/speculative/gumbel.py", "add a docstring to row_key"),
    ("backend/speculative/gumbel.py", "change _GOLDEN to a named constant GOLDEN_RATIO_64"),
    ("backend/speculative/gumbel.py", "make token_bits check that token is not negative"),
    ("backend/paths.py", "rename APP_NAME to APPLICATION"),
    ("backend/paths.py", "make log_dir create the folder if it does not exist"),
    ("backend/paths.py", "add a docstring to expand"),
    ("backend/paths.py", "remove the function documents_dir"),
    ("backend/speculative/drafters/base.py", "add a field note: str = '' to Draft"),
    ("backend/speculative/drafters/base.py", "rename StatelessHooks to NoStateHooks"),
    ("backend/speculative/drafters/base.py", "make Draft.__len__ count the parents too"),
    ("backend/speculative/drafters/base.py", "add a docstring to the Drafter protocol's propose"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=len(REQUESTS))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.models.catalog.config import load_pairs

    engine = load_engine(load_pairs()["smollm2-135m"])
    rows = []
    for n, (path, ask) in enumerate(REQUESTS[: args.limit]):
        targets = [load_edit_target(ROOT / path)]
        prompt = build_edit_prompt(targets, ask)
        modes = ("constrained", "free") if n % 2 == 0 else ("free", "constrained")
        for mode in modes:
            request = GenerationRequest(
                messages=[{"role": "user", "content": prompt}],
                sampling=SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed),
                constraint=edit_constraint(targets) if mode == "constrained" else None,
            )
            t0 = time.perf_counter()
            events = list(engine.generate(request))
            reply = "".join(e.text for e in events)
            blocks, problems = parse_blocks(reply)
            found = sum(1 for b in blocks if b.search and b.search in targets[0].text)
            plan = plan_edit(targets, reply, ask)
            outcome = "applied" if plan.changes else "refused: " + (plan.refusals[0] if plan.refusals else "?")
            row = {"request": n, "file": path, "ask": ask, "mode": mode, "blocks": len(blocks),
                   "search_found": found, "incomplete": len(problems), "outcome": outcome[:200],
                   "tokens": events[-1].stats.new_tokens if events[-1].stats else 0,
                   "seconds": round(time.perf_counter() - t0, 1), "reply": reply}  # fmt: skip
            rows.append(row)
            print(f"{n:2d} {mode:11s} blocks {len(blocks)} found {found} incomplete {len(problems)} {outcome[:90]}")
    for mode in ("constrained", "free"):
        mine = [r for r in rows if r["mode"] == mode]
        print(
            f"{mode}: requests {len(mine)}, with blocks {sum(r['blocks'] > 0 for r in mine)}, blocks "
            f"{sum(r['blocks'] for r in mine)}, SEARCH found {sum(r['search_found'] for r in mine)}, applied "
            f"{sum(r['outcome'] == 'applied' for r in mine)}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "edit_blocks.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
