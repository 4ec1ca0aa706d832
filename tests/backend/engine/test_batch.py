"""Continuous batching (backend/engine/batch.py) on a tiny model on the CPU native model: every stream's reply is
its solo run's, token for token, at any concurrency (greedy and sampled, every drafter, every γ, streams joining
at random times); join and leave between passes; cancellation; a full cache; a long prefill beside short
streams; speculation stepping aside in a batch."""

from __future__ import annotations

import random
import threading
import time

import pytest
from batch_fixtures import Collector, batched, native_engine, request, solo
from native_fixtures import native_ready  # noqa: F401  (a fixture)

from specchat.backend.engine.batch import BatchScheduler
from specchat.backend.errors import InsufficientMemoryError

DRAFTERS = ("prompt-lookup", "suffix", "draft-model", "none")


def _mixed(i: int):
    rng = random.Random(1000 + i)
    sampled = rng.random() < 0.5
    return request(
        i,
        drafter=rng.choice(DRAFTERS),
        gamma=rng.choice(["auto", 1, 2, 4, 7]),
        temperature=0.8 if sampled else 0.0,
        seed=rng.randrange(1 << 30) if sampled else None,
        tokens=rng.randrange(4, 24),
        words=rng.randrange(2, 40),
    )


@pytest.mark.parametrize("slots", [2, 5])
def test_replies_equal_their_solo_runs(slots, native_ready, tmp_path):  # noqa: F811
    engine = native_engine(tmp_path, parallel=slots, draft=True)
    requests = [_mixed(i) for i in range(12)]
    alone = [solo(engine, r) for r in requests]
    scheduler = BatchScheduler(engine, slots).start()
    try:
        got = batched(scheduler, requests)
    finally:
        scheduler.close()
    assert [c.errors for c in got] == [[]] * len(requests)
    assert [c.tokens for c in got] == alone
    assert scheduler.passes > 0 and scheduler.rows_total > scheduler.passes  # passes held several streams' rows
    # Each event's statistics say how many streams its pass held.
    assert max(e.stats.batch_streams or 0 for c in got for e in c.events if e.stats is not None) >= 2
    assert engine.cache.pool.num_used == 0  # every stream's blocks went back


def test_two_hundred_streams_joining_at_random_times(native_ready, tmp_path):  # noqa: F811
    engine = native_engine(tmp_path, parallel=8, draft=True)
    requests = [_mixed(i) for i in range(200)]
    alone = [solo(engine, r) for r in requests]
    rng = random.Random(7)
    joins = sorted(rng.uniform(0.0, 3.0) for _ in requests)
    scheduler = BatchScheduler(engine, 8).start()
    try:
        got = batched(scheduler, requests, joins=joins)
    finally:
        scheduler.close()
    differences = [i for i, (c, a) in enumerate(zip(got, alone, strict=True)) if c.tokens != a or c.errors]
    assert differences == []
    assert engine.cache.pool.num_used == 0


def test_a_long_prefill_does_not_stall_the_others(native_ready, tmp_path):  # noqa: F811
    """A 190-token prompt is read in pieces of the pass budget while a short stream keeps getting tokens."""
    engine = native_engine(tmp_path, parallel=2, context_length=512)
    short = request(1, tokens=300, words=3, drafter="none")
    long = request(2, tokens=4, words=190, drafter="none")
    alone = [solo(engine, short), solo(engine, long)]
    scheduler = BatchScheduler(engine, 2, prefill_budget=16).start()
    try:
        got = batched(scheduler, [short, long], joins=[0.0, 0.02])
    finally:
        scheduler.close()
    assert [c.tokens for c in got] == alone
    long_first = got[1].events[0]
    assert long_first.is_prefill and long_first.prefill_tokens >= 190
    # While the long prompt was read (15 passes of 15 prompt rows beside the short stream's one), the short stream
    # had a token from every pass.
    during = [t for t in got[0].times if got[1].submitted < t < got[1].times[0]]
    assert len(during) >= 190 // 15


def test_cancelling_a_stream_frees_its_slot_and_blocks(native_ready, tmp_path):  # noqa: F811
    engine = native_engine(tmp_path, parallel=2)
    cancel = threading.Event()
    scheduler = BatchScheduler(engine, 2).start()
    try:
        going = Collector()
        scheduler.submit(request(1, tokens=200, words=3), cancel, going)
        while not going.events:
            time.sleep(0.01)
        cancel.set()
        assert going.ended.wait(30)
        assert going.events[-1].finish_reason == "cancelled"
        # Its slot and blocks are free: the next request runs, and nothing is held after it.
        after = batched(scheduler, [request(2, tokens=5)])
        assert len(after[0].tokens) == 5
    finally:
        scheduler.close()
    assert engine.cache.pool.num_used == 0


def test_a_cancelled_waiting_request_never_runs(native_ready, tmp_path):  # noqa: F811
    engine = native_engine(tmp_path, parallel=1)
    scheduler = BatchScheduler(engine, 1).start()
    try:
        cancel = threading.Event()
        cancel.set()
        got = batched(scheduler, [request(1, tokens=5)], cancels={0: cancel})
        assert got[0].events == [] and got[0].errors == []
    finally:
        scheduler.close()


def test_slots_bound_the_streams_and_the_rest_wait(native_ready, tmp_path):  # noqa: F811
    engine = native_engine(tmp_path, parallel=2)
    scheduler = BatchScheduler(engine, 2).start()
    seen: list[int] = []
    real = scheduler._pass

    def watch() -> None:
        seen.append(len(scheduler.active))
        real()

    scheduler._pass = watch  # type: ignore[method-assign]
    try:
        got = batched(scheduler, [request(i, tokens=8) for i in range(5)])
    finally:
        scheduler.close()
    assert all(len(c.tokens) == 8 for c in got)
    assert max(seen) == 2


def test_a_full_cache_fails_only_that_stream(native_ready, tmp_path, monkeypatch):  # noqa: F811
    """With no memory for a request's context it waits while others run, and alone it fails with a clear
    error (serve answers 503)."""
    engine = native_engine(tmp_path, parallel=2)
    scheduler = BatchScheduler(engine, 2)
    monkeypatch.setattr("specchat.backend.engine.batch.free_memory", lambda device: 0)
    scheduler.start()
    try:
        got = batched(scheduler, [request(1, tokens=5)])
    finally:
        scheduler.close()
    assert got[0].events == []
    assert len(got[0].errors) == 1 and isinstance(got[0].errors[0], InsufficientMemoryError)
    assert "KV cache" in str(got[0].errors[0])


def test_speculation_steps_aside_as_the_batch_grows(native_ready, tmp_path):  # noqa: F811
    """With a pass cost that grows with its rows, the allocation drafts for a lone-ish pair and not for eight."""
    from specchat.backend.speculative.batch_policy import Offer, PassCost, allocate

    cost = PassCost()
    for rows, seconds in ((1, 1.0), (2, 1.46), (4, 2.54), (8, 4.35), (16, 9.8)):
        cost.observe(rows, seconds)
    good = Offer([1.0, 1.7, 2.2, 2.5], draft_s=0.01)  # α ≈ 0.7
    assert allocate([good], 1, cost)[0] > 0  # alone: worth drafting
    assert allocate([good] * 8, 8, cost) == [0] * 8  # eight streams: a pass is compute-bound, drafts do not pay
    free = PassCost()
    for rows in (1, 2, 4, 8, 16, 32):
        free.observe(rows, 1.0)  # memory-bound passes: rows cost nothing
    assert all(g > 0 for g in allocate([good] * 8, 8, free))


def test_the_eager_path_batches_by_looping(tmp_path):
    """Without the native model (transformers' forward) a pass runs each stream's rows as its own forward: replies
    still equal their solo runs, prompts are prefilled whole."""
    from engine_fixtures import tiny_engine

    engine = tiny_engine(drafter="prompt-lookup")
    engine.eos_ids = frozenset()
    assert engine.runner.native is None
    requests = [request(i, tokens=10, drafter=("prompt-lookup", "none")[i % 2], gamma=("auto", 3)[i % 2])
                for i in range(5)]  # fmt: skip
    alone = [solo(engine, r) for r in requests]
    scheduler = BatchScheduler(engine, 3).start()
    try:
        got = batched(scheduler, requests)
    finally:
        scheduler.close()
    assert [c.tokens for c in got] == alone


def test_a_lone_stream_uses_its_own_policy_and_a_batch_caps_it(native_ready, tmp_path):  # noqa: F811
    engine = native_engine(tmp_path, parallel=4)
    scheduler = BatchScheduler(engine, 4)
    caps: list[list[int | None]] = []
    real = scheduler._set_caps

    def watch(live) -> None:
        real(live)
        caps.append(list(scheduler.caps))

    scheduler._set_caps = watch  # type: ignore[method-assign]
    scheduler.start()
    try:
        batched(scheduler, [request(1, tokens=20)])
        alone_caps = list(caps)
        caps.clear()
        batched(scheduler, [request(i, tokens=20) for i in range(4)])
    finally:
        scheduler.close()
    assert all(c in ([], [None]) for c in alone_caps)  # alone: no cap, its own GammaPolicy decides
    assert any(len(c) >= 2 and all(isinstance(g, int) for g in c) for c in caps)  # together: γ per stream


def test_a_new_stream_drafts_one_token_until_its_acceptance_is_known():
    from specchat.backend.speculative.batch_policy import BatchPolicy, Offer, PassCost, allocate

    cost = PassCost()
    for rows, seconds in ((1, 1.0), (2, 1.9), (4, 3.8), (8, 7.6)):
        cost.observe(rows, seconds)  # compute-bound: no draft pays on its estimate
    fresh = BatchPolicy(max_gamma=8)
    offer = fresh.offer(8, 1.0)
    assert offer.floor == 1
    assert allocate([offer, Offer([1.0, 1.5], 0.0)], 2, cost) == [1, 0]
    for _ in range(fresh.warmup_steps):
        fresh.observe(gamma=3, proposed=3, accepted=0, draft_s=0.0, verify_s=0.0)
    assert fresh.offer(8, 1.0).floor == 0


def test_the_calibration_lets_the_thread_governor_step_between_its_passes(native_ready, tmp_path):  # noqa: F811
    """On a busy machine two threads stall at every barrier (backend/engine/threads.py): the batch's first passes,
    its calibration, must give the governor its readings as every other pass does."""
    engine = native_engine(tmp_path, parallel=2)
    steps: list[int] = []

    class Governor:
        def step(self) -> int:
            steps.append(1)
            return 1

    engine.threads = Governor()  # type: ignore[assignment]
    scheduler = BatchScheduler(engine, 2)
    scheduler._calibrate()
    assert len(steps) >= 12
    assert scheduler.cost.curve()
