"""Greedy and seeded replies of the embedded default (prompt lookup, suffix, plain) and of its EAGLE-3 pair (eagle3,
auto) at γ auto, 2 and 5, written as JSON, so two checkouts' replies can be compared token for token (a change that
should change no behaviour), and the time of each reply.

    python benchmarks/replies_dump.py OUT.json [--timing-only]      # in each checkout
    python benchmarks/replies_dump.py --compare BEFORE.json AFTER.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "List three facts about the Moon.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
]
PAIRS = [("smollm2-135m", ["none", "prompt-lookup", "suffix"]), ("smollm2-135m-eagle3", ["eagle3", "auto"])]


def dump(out: str, timing_only: bool) -> None:
    try:
        from specchat.backend.models.catalog.config import load_pairs
    except ImportError:  # a checkout from before backend/models/ had sub-packages
        from specchat.backend.models.config import load_pairs  # type: ignore[no-redef]
    from specchat.backend.api import GenerationRequest, SamplingParams
    from specchat.backend.engine.engine import load_engine

    replies = []
    pairs = load_pairs()
    for pair_name, drafters in PAIRS[:1] if timing_only else PAIRS:
        engine = load_engine(pairs[pair_name])
        for drafter in drafters:
            for gamma in [None] if timing_only else [None, 2, 5]:
                for prompt in PROMPTS:
                    for seed in [None] if timing_only else [None, 1, 7]:
                        sampling = SamplingParams(
                            temperature=0.0 if seed is None else 0.8, max_new_tokens=96, seed=seed
                        )
                        messages = [{"role": "user", "content": prompt}]
                        request = GenerationRequest(messages=messages, sampling=sampling, drafter=drafter, gamma=gamma)
                        start = time.perf_counter()
                        ids = [t for event in engine.generate(request) for t in event.token_ids]
                        replies.append(
                            {"pair": pair_name, "drafter": drafter, "gamma": gamma, "prompt": prompt[:20], "seed": seed,
                             "ids": ids, "s": time.perf_counter() - start}
                        )  # fmt: skip
        del engine
    with open(out, "w") as file:
        json.dump(replies, file)
    print(len(replies), "replies")


def compare(before: str, after: str) -> None:
    def key(r: dict) -> tuple:
        return r["pair"], r["drafter"], r["gamma"], r["prompt"], r["seed"]

    old = {key(r): r for r in json.load(open(before))}
    new = {key(r): r for r in json.load(open(after))}
    differ = [k for k in old if k not in new or old[k]["ids"] != new[k]["ids"]]
    print(f"{len(old)} replies, {sum(len(r['ids']) for r in old.values())} tokens; {len(differ)} differ")
    for drafter in sorted({k[1] for k in old}):
        rates = [(len(old[k]["ids"]) / old[k]["s"], len(new[k]["ids"]) / new[k]["s"]) for k in old if k[1] == drafter]
        before_rate = statistics.median(r[0] for r in rates)
        after_rate = statistics.median(r[1] for r in rates)
        print(f"{drafter}: {before_rate:.1f} -> {after_rate:.1f} tok/s (median over {len(rates)} replies)")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        dump(sys.argv[1], "--timing-only" in sys.argv)
