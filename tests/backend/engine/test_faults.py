"""Faults while generating (issue 7, part 2): the KV pool running out mid-reply, a drafter raising, host/CUDA
out-of-memory in the draft or the target, and cancellation at hundreds of random moments.

Every test checks the block accounting afterwards (the target pool and the draft pool) and, where a
conversation survives the fault, that its next turn gives exactly what a fresh engine gives (the cached
history is consistent). Greedy decoding is lossless, so "the reply continued without speculation" is checked
token for token against plain decoding.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from engine_fixtures import tiny_engine
from tiny_models import one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, PolicyState, SamplingParams
from specchat.backend.errors import InsufficientMemoryError, KVCacheFullError, SpecchatError

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=30)


def run(engine, cancel=None, **kw):
    events = list(engine.generate(GenerationRequest(**kw), cancel))
    return [t for e in events for t in e.token_ids], events


def repetitive(seed: int = 0) -> list[int]:
    base = random_ids(10, seed=seed)
    return base * 3 + base[:4]


def expected_blocks(engine) -> int:
    """Blocks the kept conversations must hold: exactly their committed tokens, nothing reserved beyond."""
    bs = engine.cache.pool.block_size
    total = 0
    for conv in engine._conversations.values():
        assert conv.seq.length == len(conv.cached), "cached ids and committed K/V disagree"
        assert len(conv.seq.block_table) == -(-conv.seq.length // bs), "blocks reserved past the committed length"
        total += len(conv.seq.block_table)
    return total


def draft_blocks_ok(engine) -> None:
    if engine.draft_cache is None:
        return
    drafter = engine.drafters.get("draft-model")
    held = len(drafter.seq.block_table) if drafter is not None and drafter.seq.block_table is not None else 0
    assert engine.draft_cache.pool.num_used == held


class Fail:
    """Wrap a callable so that calls number ``at`` (0-based) onwards raise ``error`` (``times`` of them)."""

    def __init__(self, fn, error: BaseException, at: int, times: int = 10**9) -> None:
        self.fn, self.error, self.at, self.times, self.calls, self.raised = fn, error, at, times, 0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls - 1 >= self.at and self.raised < self.times:
            self.raised += 1
            raise self.error
        return self.fn(*args, **kwargs)


# --- the KV pool running out --------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter, gamma", [("none", "auto"), ("prompt-lookup", 4)])
def test_pool_runs_out_mid_reply_finishes_with_context_and_frees(drafter, gamma):
    # Context allows 256 tokens but the pool holds 48 (3 blocks): the reply must stop at the pool's end.
    engine = tiny_engine("llama", drafter=drafter, gamma=gamma, kv_tokens=48)
    prompt = repetitive(0)  # 34 tokens
    ids, events = run(engine, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_new_tokens=100))
    last = events[-1]
    assert last.finish_reason == "context"
    assert "KV cache is full" in last.message and "context_length" in last.message
    assert 0 < len(ids) and len(prompt) + len(ids) <= 48 + 1
    assert engine.blocks_in_use() == 0
    # The output so far is the plain greedy output (nothing corrupted on the way out).
    plain, _ = run(
        tiny_engine("llama", drafter="none"),
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0, max_new_tokens=len(ids)),
    )
    assert ids == plain


def test_pool_full_in_a_conversation_keeps_history_and_frees_on_forget():
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=3, kv_tokens=64)
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(10, 40))}]
    ids, events = run(
        engine, messages=messages, conversation="c", sampling=SamplingParams(temperature=0, max_new_tokens=200)
    )
    assert events[-1].finish_reason == "context"
    assert engine.blocks_in_use() == expected_blocks(engine) > 0
    engine.forget("c")
    assert engine.blocks_in_use() == 0


def test_prompt_larger_than_the_pool_is_refused_and_frees():
    engine = tiny_engine("llama", drafter="none", kv_tokens=32)
    with pytest.raises(KVCacheFullError, match="KV cache is full.*context_length"):
        run(engine, prompt_ids=random_ids(60), sampling=GREEDY, conversation="c")
    assert engine.blocks_in_use() == expected_blocks(engine)
    engine.close()
    assert engine.blocks_in_use() == 0
    ids, events = run(engine, prompt_ids=random_ids(10), sampling=GREEDY)  # the engine still works
    assert events[-1].finish_reason in ("length", "eos", "context")


# --- a drafter raising ---------------------------------------------------------------------------------------


def test_prompt_lookup_exception_continues_without_speculation():
    prompt = repetitive(2)
    plain, _ = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=3)
    drafter = engine.drafters["prompt-lookup"]
    drafter.propose = Fail(drafter.propose, ValueError("n-gram index broken"), at=2)
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert ids == plain
    notices = [e.message for e in events if e.message]
    assert len(notices) == 1
    assert "prompt-lookup drafter failed" in notices[0] and "n-gram index broken" in notices[0]
    assert "continuing without it" in notices[0]
    failed_at = next(i for i, e in enumerate(events) if e.message)
    # The failing step verified no draft (it did not pause); afterwards there is no drafter: plain decoding.
    assert events[failed_at].gamma == 0 and events[failed_at].policy == PolicyState.NO_DRAFT
    assert all(e.gamma == 0 and e.policy == PolicyState.OFF for e in events[failed_at + 1 :])
    assert events[-1].finish_reason == "length" and engine.blocks_in_use() == 0
    # The failure is per request: the next request speculates again.
    drafter.propose.times = drafter.propose.raised
    _, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert any(e.gamma > 0 for e in events) and not any(e.message for e in events)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        MemoryError(),
    ],
)
def test_draft_model_oom_falls_back_to_plain_decoding(error):
    prompt = repetitive(0)
    plain, _ = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    engine = tiny_engine("llama", drafter="draft-model", draft_family="llama", draft_seed=1, gamma=3)
    draft_model = engine.draft.model
    draft_model.forward = Fail(draft_model.forward, error, at=3)
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY, conversation="c")
    assert ids == plain and events[-1].finish_reason == "length"
    notices = [e.message for e in events if e.message]
    assert len(notices) == 1 and "draft-model drafter" in notices[0] and "out of memory" in notices[0]
    assert "plain decoding" in notices[0]
    assert engine.blocks_in_use() == expected_blocks(engine)
    assert engine.draft_cache.pool.num_used == 0  # the draft's KV blocks went back when it was switched off
    # Out of memory switches the draft model off for the engine's life: the next request says so and runs plain.
    calls = draft_model.forward.calls
    ids2, events2 = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert ids2 == plain and draft_model.forward.calls == calls
    assert "draft-model" in (events2[0].message or "") and "off" in events2[0].message
    engine.close()
    assert engine.blocks_in_use() == 0 and engine.draft_cache.pool.num_used == 0


def test_draft_model_bug_is_reported_per_request_and_frees_draft_blocks():
    prompt = repetitive(3)
    plain, _ = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    engine = tiny_engine("llama", drafter="draft-model", draft_family="llama", draft_seed=1, gamma=2)
    engine.draft.model.forward = Fail(engine.draft.model.forward, IndexError("index 7 is out of bounds"), at=5, times=1)
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert ids == plain
    assert any("IndexError" in (e.message or "") for e in events)
    draft_blocks_ok(engine)
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)  # not an OOM: the next request drafts again
    assert ids == plain and any(e.gamma > 0 for e in events)


# --- the target running out of memory ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        MemoryError(),
    ],
)
@pytest.mark.parametrize("at", [0, 4])  # prefill, or mid-reply
def test_target_oom_ends_the_request_with_a_clear_error_and_frees(error, at):
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=3)
    messages = [{"role": "user", "content": "w10 w11 w12 w13 w10 w11 w12 w13 w10"}]
    run(engine, messages=messages, conversation="c", sampling=GREEDY)  # a turn already cached
    messages = messages + [{"role": "assistant", "content": "w20 w21"}, {"role": "user", "content": "w30 w31"}]
    model = engine.target.model
    real = model.forward
    model.forward = Fail(real, error, at=at)
    with pytest.raises(InsufficientMemoryError) as info:
        run(engine, messages=messages, conversation="c", sampling=GREEDY)
    text = str(info.value)
    assert "out of memory" in text and "target" in text
    assert "max_new_tokens" in text or "context_length" in text  # what to do
    assert engine.blocks_in_use() == expected_blocks(engine)
    # The conversation is still usable and consistent: the retried turn equals a fresh engine's.
    model.forward = real
    again, _ = run(engine, messages=messages, conversation="c", sampling=GREEDY)
    fresh, _ = run(tiny_engine("llama", drafter="prompt-lookup", gamma=3), messages=messages, sampling=GREEDY)
    assert again == fresh
    engine.forget("c")
    assert engine.blocks_in_use() == 0


def test_other_target_errors_keep_their_type_but_free_the_blocks():
    engine = tiny_engine("llama", drafter="none")
    engine.target.model.forward = Fail(engine.target.model.forward, RuntimeError("shape mismatch [2, 3]"), at=2)
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        run(engine, prompt_ids=random_ids(20), sampling=GREEDY, conversation="c")
    assert not isinstance(info.value, SpecchatError)  # a bug keeps its traceback; it is not dressed up
    assert engine.blocks_in_use() == expected_blocks(engine)


# --- cancellation at random moments ------------------------------------------------------------------------


def _turn(rng: random.Random, engine, history: dict, key: str | None, cancel_after: int | None, close: bool):
    """One request; cancel after ``cancel_after`` events (or abandon the generator when ``close``)."""
    messages = list(history.get(key, [])) + [
        {"role": "user", "content": " ".join(f"w{rng.randrange(6, 40)}" for _ in range(rng.randrange(1, 8)))}
    ]
    cancel = threading.Event()
    if cancel_after == -1:
        cancel.set()  # cancelled before prefill
    gen = engine.generate(
        GenerationRequest(
            messages=messages,
            conversation=key,
            drafter=rng.choice(["none", "prompt-lookup", "draft-model", "auto"]),
            sampling=SamplingParams(
                temperature=rng.choice([0.0, 0.9]), max_new_tokens=rng.randrange(2, 10), seed=rng.randrange(1000)
            ),
        ),
        cancel,
    )
    text, last = [], None
    for n, event in enumerate(gen):
        text.append(event.text)
        last = event
        if cancel_after is not None and n + 1 >= cancel_after:
            if close:
                gen.close()
                break
            cancel.set()
    if last is not None and last.finish_reason is not None:
        assert last.finish_reason in ("eos", "length", "cancelled", "context", "stop")
        if cancel_after is not None and not close and last.finish_reason == "cancelled":
            assert last.stats is not None
    if key is not None:
        history[key] = messages + [{"role": "assistant", "content": "".join(text)}]


def test_cancel_at_random_moments_hundreds_of_times():
    rng = random.Random(7)
    engine = tiny_engine("llama", drafter="prompt-lookup", draft_family="llama", draft_seed=0, context_length=128)
    history: dict = {}
    keys = [None, "a", "b", "c"]
    for i in range(200):
        key = rng.choice(keys)
        cancel_after = rng.choice([None, -1, 1, 1, 2, 3, 5])
        _turn(rng, engine, history, key, cancel_after, close=rng.random() < 0.3)
        assert engine.blocks_in_use() == expected_blocks(engine), f"turn {i}"
        draft_blocks_ok(engine)
        if key is not None and len(history[key]) > 12:
            del history[key]
            engine.forget(key)
    # History consistency: each surviving conversation's next turn equals a fresh engine's greedy answer.
    for key, messages in history.items():
        messages = messages + [{"role": "user", "content": "w9 w8"}]
        cached, _ = run(
            engine,
            messages=messages,
            conversation=key,
            drafter="none",
            sampling=SamplingParams(temperature=0, max_new_tokens=6),
        )
        fresh, _ = run(
            tiny_engine("llama", drafter="none", context_length=128),
            messages=messages,
            sampling=SamplingParams(temperature=0, max_new_tokens=6),
        )
        assert cached == fresh, key
    for key in list(history):
        engine.forget(key)
    assert engine.blocks_in_use() == 0
    engine.close()
    assert engine.blocks_in_use() == 0 and engine.draft_cache.pool.num_used == 0
