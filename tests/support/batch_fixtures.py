"""Engines for the batching tests (backend/engine/batch.py): a tiny llama target on the CPU native model (row for
row the same alone or in a batch), optionally a tiny draft model; and helpers that run requests alone or through
a BatchScheduler and collect each reply's tokens."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from engine_fixtures import tiny_loaded, tiny_pair
from native_fixtures import tiny_native_loaded

from specchat.backend.api import GenerationRequest, SamplingParams, StepEvent
from specchat.backend.engine.batch import BatchScheduler
from specchat.backend.engine.engine import Engine


def native_engine(folder: Path, *, parallel: int = 4, draft: bool = False, context_length: int = 256) -> Engine:
    loaded = tiny_native_loaded(folder)
    # A draft of another seed: it agrees with the target sometimes, as a real one does.
    draft_model = tiny_loaded("llama", seed=1) if draft else None
    pair = tiny_pair(drafter="draft-model" if draft else "prompt-lookup", context_length=context_length)
    engine = Engine(loaded, draft_model, pair, parallel=parallel)
    engine.eos_ids = frozenset()  # a random tiny model says EOS often: run every reply to its limit
    assert engine.runner.native is not None, "the tiny target must run on the native model"
    return engine


def request(i: int, *, drafter: str = "prompt-lookup", gamma="auto", temperature: float = 0.0, tokens: int = 16,
            words: int = 8, seed: int | None = None) -> GenerationRequest:  # fmt: skip
    rng = random.Random(i)
    content = " ".join(f"w{rng.choice([10, 11, 12, 13, 20, 21, 30])}" for _ in range(words))
    sampling = SamplingParams(temperature=temperature, max_new_tokens=tokens, seed=seed)
    return GenerationRequest(
        messages=[{"role": "user", "content": content}], sampling=sampling, drafter=drafter, gamma=gamma
    )


def solo(engine: Engine, req: GenerationRequest) -> list[int]:
    return [t for e in engine.generate(req) for t in e.token_ids]


class Collector:
    """What a BatchScheduler hands one stream's sink: events, errors, the end."""

    def __init__(self) -> None:
        self.events: list[StepEvent] = []
        self.times: list[float] = []  # perf_counter() at each event
        self.submitted = 0.0
        self.errors: list[BaseException] = []
        self.ended = threading.Event()

    def __call__(self, item) -> None:
        if item is None:
            self.ended.set()
        elif isinstance(item, BaseException):
            self.errors.append(item)
        else:
            self.events.append(item)
            self.times.append(time.perf_counter())

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]


def batched(
    scheduler: BatchScheduler,
    requests: list[GenerationRequest],
    *,
    joins: list[float] | None = None,
    cancels: dict[int, threading.Event] | None = None,
    timeout_s: float = 300.0,
) -> list[Collector]:
    """Submit ``requests`` (request i after ``joins[i]`` seconds from the start) and wait for every reply."""
    out = [Collector() for _ in requests]
    t0 = time.perf_counter()
    order = sorted(range(len(requests)), key=lambda i: joins[i] if joins else 0.0)
    for i in order:
        if joins:
            time.sleep(max(0.0, t0 + joins[i] - time.perf_counter()))
        cancel = (cancels or {}).get(i) or threading.Event()
        out[i].submitted = time.perf_counter()
        scheduler.submit(requests[i], cancel, out[i])
    for collector in out:
        assert collector.ended.wait(timeout_s), "a stream never ended"
    return out
