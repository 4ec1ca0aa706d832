"""Write long held-out-style prompts (a `specchat bench --prompts` file) of chosen token lengths.

    python benchmarks/long_prompts.py --out /tmp/long.jsonl --tokens 200 1000 2000 3000 4000

Each length gets two prompts, both made only of text shipped in the package (none of it in any training data of
the project's heads): a summary of Spec-Bench's summarization and RAG articles put one after another, and
questions about one of specchat's own source files. A prompt is cut to the length at a line boundary, counted
with the pair's tokenizer on the rendered chat prompt, so the numbers printed are what the engine prefills.
Used for issue 32's replay over prompts of 64-4,000 tokens (`specchat bench --replay --prompts FILE`).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import specchat.backend
from specchat.backend.bench.suites import load_spec_bench
from specchat.backend.engine.prompting import render
from specchat.backend.models.catalog.config import get_pair, load_pairs
from specchat.backend.models.loading.pair import load_tokenizer

SOURCES = ("backend/speculative/verify.py", "backend/kv/kv_cache.py", "backend/kv/block_pool.py")


def articles() -> list[str]:
    """The Spec-Bench summarization and RAG prompts' texts, in file order."""
    return [p.messages[0][1] for p in load_spec_bench() if p.family in ("summarization", "rag")]


def source_lines(relative: str) -> list[str]:
    return (Path(specchat.backend.__file__).parent.parent / relative).read_text(encoding="utf-8").splitlines()


def fit(lines: list[str], head: str, tail: str, target: int, count) -> str:
    """The longest prefix of ``lines`` (whole lines) whose prompt ``head + lines + tail`` has ≤ target tokens."""
    low, high = 0, len(lines)
    while low < high:  # binary search over the number of lines kept
        mid = (low + high + 1) // 2
        if count(head + "\n".join(lines[:mid]) + tail) <= target:
            low = mid
        else:
            high = mid - 1
    return head + "\n".join(lines[:low]) + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--tokens", type=int, nargs="+", default=[200, 1000, 2000, 3000, 4000])
    parser.add_argument("--pair", default="smollm2-135m", help="whose tokenizer and chat template count tokens")
    args = parser.parse_args()
    tokenizer = load_tokenizer(get_pair(load_pairs(None), args.pair).target)

    def count(text: str) -> int:
        return len(render(tokenizer, [{"role": "user", "content": text}]))

    news = [s for text in articles() for s in re.split(r"(?<=[.!?])\s+", text)]  # a sentence a line: fine cuts
    rows = []
    for i, target in enumerate(args.tokens):
        text = fit(news, "Summarise the following articles, one short paragraph each.\n\n", "\n", target, count)
        rows.append({"id": f"long-summary-{target}", "messages": [{"role": "user", "content": text}]})
        rotated = SOURCES[i % len(SOURCES) :] + SOURCES[: i % len(SOURCES)]
        code = [line for name in rotated for line in source_lines(name)]  # files one after another; cut to fit
        head = "Here is part of a Python project.\n\n```python\n"
        tail = "\n```\n\nExplain what this code does and name one way it could fail."
        text = fit(code, head, tail, target, count)
        rows.append({"id": f"long-code-{target}", "messages": [{"role": "user", "content": text}]})
    with open(args.out, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
            print(row["id"], count(row["messages"][0]["content"]), "tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
