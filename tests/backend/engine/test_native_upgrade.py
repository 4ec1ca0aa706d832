"""A first start replies on the path that needs no compiler while the kernels build in the background, and the
engine swaps the native model in between replies once they are loaded (backend/engine/upgrade.py; issue 48
item 3). The background build itself is tests/backend/kernels/test_native_retry.py; here the library is built
(``native_ready``) and ``native.poll`` says when the engine may take it."""

from __future__ import annotations

import pytest
from native_fixtures import native_ready  # noqa: F401  (a fixture)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.kernels import native
from specchat.backend.kernels.native_library import BUILDING
from specchat.backend.kv.attention import ATTN_IMPLEMENTATION
from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.loading.pair import load_model

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_new_tokens=24)


def _reply(engine, **kwargs):
    ids = []
    for event in engine.generate(GenerationRequest(messages=CHAT, sampling=SEEDED, conversation="c", **kwargs)):
        ids.extend(event.token_ids)
    return ids


def _waiting_engine(monkeypatch) -> Engine:
    """The default pair as a first start loads it while the kernels build: the int4 compact forward."""
    pair = load_pairs()["smollm2-135m"]
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")
    fallback = load_model(pair.target, "cpu", attn_implementation=ATTN_IMPLEMENTATION)
    monkeypatch.delenv("SPECCHAT_NATIVE")
    fallback.native_reason = f"{BUILDING} (2 s) (log: build.log); they take over between replies when ready"
    return Engine(fallback, None, pair)


def test_the_native_model_takes_over_between_replies(native_ready, monkeypatch):  # noqa: F811
    engine = _waiting_engine(monkeypatch)
    assert engine.runner.path == "cpu-compact" and BUILDING in engine.start_line
    monkeypatch.setattr(native, "poll", lambda: False)
    monkeypatch.setattr(native, "building", lambda: True)
    first = _reply(engine)
    assert engine.runner.path == "cpu-compact" and _reply(engine) == first  # seeded replay, on one path
    monkeypatch.setattr(native, "poll", lambda: True)  # the background build is done: the library is loaded
    monkeypatch.setattr(native, "building", lambda: False)
    swapped = _reply(engine)
    assert engine.runner.path == "cpu-native" and engine.start_line.startswith("CPU native (")
    assert engine.fallback_reason is None
    assert _reply(engine) == swapped  # seeded replay, on the new path
    native_engine = Engine(
        load_model(engine.pair.target, "cpu", attn_implementation=ATTN_IMPLEMENTATION), None, engine.pair
    )
    assert native_engine.runner.path == "cpu-native" and _reply(native_engine) == swapped


def test_a_build_that_fails_meanwhile_is_named_and_nothing_swaps(native_ready, monkeypatch):  # noqa: F811
    engine = _waiting_engine(monkeypatch)
    monkeypatch.setattr(native, "poll", lambda: False)
    monkeypatch.setattr(native, "building", lambda: False)
    monkeypatch.setattr(native, "reason", lambda: "the build failed: c++: error (log: build.log)")
    _reply(engine)
    assert engine.runner.path == "cpu-compact"
    assert "the CPU kernels are unavailable: the build failed: c++: error" in engine.start_line


def test_the_batch_scheduler_swaps_between_replies_too(native_ready, monkeypatch):  # noqa: F811
    """`specchat serve` with several streams: the scheduler swaps when no stream is active, and its replies then
    run on the native model."""
    from batch_fixtures import batched

    from specchat.backend.engine.batch import BatchScheduler

    engine = _waiting_engine(monkeypatch)
    monkeypatch.setattr(native, "poll", lambda: True)
    monkeypatch.setattr(native, "building", lambda: False)
    scheduler = BatchScheduler(engine, 2).start()
    try:
        got = batched(scheduler, [GenerationRequest(messages=CHAT, sampling=SEEDED)] * 2)
    finally:
        scheduler.close()
    assert [c.errors for c in got] == [[], []] and engine.runner.path == "cpu-native"
    alone = [t for e in engine.generate(GenerationRequest(messages=CHAT, sampling=SEEDED)) for t in e.token_ids]
    assert [[t for e in c.events for t in e.token_ids] for c in got] == [alone, alone]
