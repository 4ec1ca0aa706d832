"""Predicted outputs through `specchat serve` with the `openai` client against the same requests in process.

Issue 35 asks that a rewrite sent through the API with ``prediction`` run within 10% of the engine's own speed.
For each of the first ``--limit`` prompts of the bench's ``rewrite`` family (the file to change in the message,
the file itself as the prediction), the script runs, in an order that alternates per prompt:

- in process: ``Engine.generate`` with ``GenerationRequest(prediction=...)``, timed from the call to the last event;
- served: ``openai.OpenAI(base_url=...).chat.completions.create(..., prediction={"type": "content", ...})``
  against a `specchat serve` started by the script (the same pair, its engine warmed by one request first),
  timed by the client from the request to the parsed response (HTTP and JSON included).

Both greedy with the prompt's ``max_new_tokens`` and no stop (the reply opens its own code block, so the
family's closing-fence stop would end it at once); the texts must be equal (the script says when not). Prints one
line per run and the ratio of total tokens/s, served over in-process. Needs ``pip install openai`` (a measuring
tool only, not a dependency of specchat).

    python benchmarks/prediction_api.py --limit 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from serve_vs_generate import start_server  # this folder's: starts `specchat serve --pair smollm2-135m --port 0`

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.bench.suites import load_suite
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.config import get_pair, load_pairs

PAIR = "smollm2-135m"


def in_process(engine, messages: list[dict], prediction: str, max_new: int) -> tuple[str, int, float]:
    request = GenerationRequest(
        messages=messages, sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new), prediction=prediction
    )
    start = time.perf_counter()
    events = list(engine.generate(request))
    wall = time.perf_counter() - start
    return "".join(e.text for e in events), events[-1].stats.new_tokens, wall


def served(client, messages: list[dict], prediction: str, max_new: int) -> tuple[str, int, float]:
    start = time.perf_counter()
    response = client.chat.completions.create(
        model=PAIR,
        messages=messages,
        max_tokens=max_new,
        temperature=0,
        prediction={"type": "content", "content": prediction},
    )
    wall = time.perf_counter() - start
    return response.choices[0].message.content or "", response.usage.completion_tokens, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="rewrite prompts (in the family's file order)")
    args = parser.parse_args()
    import openai

    prompts = load_suite("rewrite", None)[: args.limit]
    engine = load_engine(get_pair(load_pairs(None), PAIR))
    proc, url = start_server(dict(os.environ))
    try:
        client = openai.OpenAI(base_url=url.rstrip("/"), api_key="unused", timeout=600)
        warm = [{"role": "user", "content": "Say hello."}]
        served(client, warm, "Hello!", 8)
        in_process(engine, warm, "Hello!", 8)
        totals = {"in-process": [0, 0.0], "served": [0, 0.0]}
        for index, prompt in enumerate(prompts):
            messages, prediction = prompt.message_dicts(), prompt.prediction or ""
            max_new = prompt.max_new_tokens or 512
            order = ("in-process", "served") if index % 2 == 0 else ("served", "in-process")
            texts = {}
            for which in order:
                run = in_process if which == "in-process" else served
                text, tokens, wall = run(engine if which == "in-process" else client, messages, prediction, max_new)
                texts[which] = text
                totals[which][0] += tokens
                totals[which][1] += wall
                print(f"{prompt.id:40s} {which:10s} {tokens:5d} tokens {wall:7.2f} s {tokens / wall:7.1f} tok/s")
            if texts["in-process"] != texts["served"]:
                print(f"{prompt.id}: the two replies differ", file=sys.stderr)
        rates = {k: t / s for k, (t, s) in totals.items()}
        print(
            f"total: in-process {rates['in-process']:.1f} tok/s, served {rates['served']:.1f} tok/s, "
            f"served / in-process {rates['served'] / rates['in-process']:.3f}"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
