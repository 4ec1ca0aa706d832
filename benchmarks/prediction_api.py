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

The two sides start every request from the same state: the server forgets what earlier requests taught its
engine (reply memory, γ policies' acceptance estimates, drafters' caches: `specchat serve`'s default, for
isolation between clients), so the in-process engine runs with its reply memory off and forgets before each
request too; each served request names its own ``prompt_cache_key``, so no repeat finds its prompt in the
server's prefix cache (both prefill the whole prompt). Each run also prints the engine's own ``wall_s`` (the
served one from the response's ``specchat.stats``): client time minus it is the HTTP side's share.

``--repeats`` runs every prompt that many times, the order of the two sides alternating per run; prints the
ratio of total tokens/s and the median of the per-run ratios.

    python benchmarks/prediction_api.py --limit 4 --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

from serve_vs_generate import start_server  # this folder's: starts `specchat serve --pair smollm2-135m --port 0`

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.bench.suites import load_suite
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import get_pair, load_pairs

PAIR = "smollm2-135m"


KEYS = itertools.count()


def in_process(engine, messages: list[dict], prediction: str, max_new: int) -> tuple[str, int, float, float]:
    """(text, tokens, wall seconds from the call to the last event, the engine's own wall_s)."""
    request = GenerationRequest(
        messages=messages, sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new), prediction=prediction
    )
    engine.forget_requests()  # as the server does before each request
    start = time.perf_counter()
    events = list(engine.generate(request))
    wall = time.perf_counter() - start
    return "".join(e.text for e in events), events[-1].stats.new_tokens, wall, events[-1].stats.wall_s


def served(client, messages: list[dict], prediction: str, max_new: int) -> tuple[str, int, float, float]:
    """(text, tokens, wall seconds from the request to the parsed response, the server's engine wall_s)."""
    start = time.perf_counter()
    response = client.chat.completions.create(
        model=PAIR,
        messages=messages,
        max_tokens=max_new,
        temperature=0,
        prediction={"type": "content", "content": prediction},
        extra_body={"prompt_cache_key": f"run-{next(KEYS)}"},  # a scope of its own: nothing kept to start from
    )
    wall = time.perf_counter() - start
    engine_s = (response.model_extra or {}).get("specchat", {}).get("stats", {}).get("wall_s", float("nan"))
    return response.choices[0].message.content or "", response.usage.completion_tokens, wall, engine_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="rewrite prompts (in the family's file order)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each prompt on each side")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `specchat serve` argument")
    args = parser.parse_args()
    import openai

    prompts = load_suite("rewrite", None)[: args.limit]
    engine = load_engine(get_pair(load_pairs(None), PAIR))
    engine.use_reply_memory(False)  # as `specchat serve` without --share-state
    proc, url = start_server(dict(os.environ), *args.serve_arg)
    try:
        client = openai.OpenAI(base_url=url.rstrip("/"), api_key="unused", timeout=600)
        warm = [{"role": "user", "content": "Say hello."}]
        served(client, warm, "Hello!", 8)
        in_process(engine, warm, "Hello!", 8)
        totals = {"in-process": [0, 0.0], "served": [0, 0.0]}
        ratios = []
        runs = [(prompt, r) for r in range(args.repeats) for prompt in prompts]
        for index, (prompt, repeat) in enumerate(runs):
            messages, prediction = prompt.message_dicts(), prompt.prediction or ""
            max_new = prompt.max_new_tokens or 512
            order = ("in-process", "served") if index % 2 == 0 else ("served", "in-process")
            texts, rates = {}, {}
            for which in order:
                run = in_process if which == "in-process" else served
                text, tokens, wall, engine_s = run(
                    engine if which == "in-process" else client, messages, prediction, max_new
                )
                texts[which], rates[which] = text, tokens / wall
                totals[which][0] += tokens
                totals[which][1] += wall
                print(
                    f"{prompt.id:32s} #{repeat + 1} {which:10s} {tokens:5d} tokens {wall:7.2f} s {tokens / wall:7.1f} "
                    f"tok/s (engine {engine_s:7.2f} s, outside it {wall - engine_s:6.3f} s)",
                    flush=True,
                )
            ratios.append(rates["served"] / rates["in-process"])
            if texts["in-process"] != texts["served"]:
                print(f"{prompt.id}: the two replies differ", file=sys.stderr)
        totals_rate = {k: t / s for k, (t, s) in totals.items()}
        print(
            f"total: in-process {totals_rate['in-process']:.1f} tok/s, served {totals_rate['served']:.1f} tok/s, "
            f"served / in-process {totals_rate['served'] / totals_rate['in-process']:.3f}; median of {len(ratios)} "
            f"per-run ratios {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
