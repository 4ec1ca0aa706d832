"""Model-level engine tests on tiny random-weight models: the layer between the pure units (tests/backend/kv,
tests/backend/speculative) and the app's pilot tests; test_real_model.py repeats the key checks on the embedded model.

Greedy plain == transformers generate() greedy, token for token, per family; greedy speculative == greedy
plain for every drafter, including EOS inside a draft, max tokens reached mid-draft and a rejection at every
position; multi-turn prefix reuse prefills only what differs; sampling is reproducible under a seed.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from engine_fixtures import hf_greedy, tiny_engine
from tiny_models import FAMILIES, one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, PolicyState, SamplingParams, TokenSource
from specchat.backend.errors import RequestError
from specchat.backend.speculative.drafters.base import Draft, StatelessHooks

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)


def run(engine, **kw):
    """Generate and return (token_ids, events)."""
    events = list(engine.generate(GenerationRequest(**kw)))
    ids = [t for e in events for t in e.token_ids]
    return ids, events


def repetitive_prompt(seed: int = 0) -> list[int]:
    # Repeated n-grams give prompt lookup something to match.
    base = random_ids(12, seed=seed)
    return base * 3 + base[:5]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_greedy_equals_transformers_generate(family):
    prompt = random_ids(30, seed=1)
    engine = tiny_engine(family, drafter="none")
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert ids == hf_greedy(family, prompt, 40)
    assert events[0].is_prefill and events[0].prefill_tokens == 30
    assert all(s == TokenSource.TARGET for e in events for s in e.sources)
    assert all(e.policy == PolicyState.OFF for e in events)
    assert engine.blocks_in_use() == 0  # a scratch request frees everything


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("gamma", [1, 3, "auto"])
def test_prompt_lookup_greedy_equals_plain(family, gamma):
    prompt = repetitive_prompt()
    plain, _ = run(tiny_engine(family, drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    ids, events = run(tiny_engine(family, drafter="prompt-lookup", gamma=gamma), prompt_ids=prompt, sampling=GREEDY)
    assert ids == plain
    stats = events[-1].stats
    assert stats.new_tokens == len(ids)


def test_draft_model_twin_accepts_everything_and_matches_plain():
    prompt = random_ids(20, seed=3)
    plain, _ = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    engine = tiny_engine("llama", drafter="draft-model", draft_family="llama", gamma=4)
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert ids == plain
    stats = events[-1].stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted
    assert any(TokenSource.BONUS in e.sources for e in events)


def test_draft_model_unrelated_draft_still_lossless():
    prompt = random_ids(20, seed=4)
    plain, _ = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    engine = tiny_engine("llama", drafter="draft-model", draft_family="llama", draft_seed=7, gamma=3)
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert ids == plain
    assert any(TokenSource.RECOVERED in e.sources for e in events)


class ScriptedDrafter(StatelessHooks):
    """Proposes a fixed function of the context, for forcing rejections and EOS inside drafts."""

    name = "prompt-lookup"

    def __init__(self, fn):
        self.fn = fn

    def reset(self):
        pass

    def propose(self, context, max_tokens):
        return Draft(token_ids=self.fn(list(context))[:max_tokens])

    def observe(self, num_accepted):
        pass


def test_rejection_at_every_position():
    prompt = random_ids(16, seed=5)
    plain, _ = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    for position in range(4):
        engine = tiny_engine("llama", drafter="prompt-lookup", gamma=4)

        # Draft the true continuation up to `position`, then a wrong token.
        def script(context, position=position):
            n = len(context) - len(prompt)
            truth = plain[n : n + 4]
            draft = list(truth)
            if position < len(draft):
                draft[position] = (draft[position] + 1) % 120 + 3
            return draft

        engine.drafters["prompt-lookup"] = ScriptedDrafter(script)
        ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
        assert ids == plain, f"rejection at position {position} changed the output"
        spec = [e for e in events if e.gamma == 4]
        assert spec and all(e.accepted == position for e in spec[:-1])


def test_eos_inside_draft_and_max_tokens_mid_draft():
    prompt = random_ids(16, seed=6)
    plain, _ = run(
        tiny_engine("llama", drafter="none"),
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0, max_new_tokens=7),
    )
    assert len(plain) == 7
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=5)

    # A perfect drafter that always proposes 5 tokens: max_new_tokens 7 ends inside a draft.
    def truth(context):
        n = len(context) - len(prompt)
        return plain[n : n + 5] + [2] * 5

    engine.drafters["prompt-lookup"] = ScriptedDrafter(truth)
    ids, events = run(engine, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_new_tokens=7))
    assert ids == plain and events[-1].finish_reason == "length"
    # EOS inside a draft: make the 4th plain token an end-of-sequence id; a perfect drafter proposes past it.
    cut = next(i for i in range(2, 7) if plain[i] not in plain[:i])
    eos = plain[cut]
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=5)
    engine.eos_ids = frozenset({eos})
    engine.drafters["prompt-lookup"] = ScriptedDrafter(truth)
    ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
    assert ids == plain[: cut + 1] and events[-1].finish_reason == "eos"
    assert engine.blocks_in_use() == 0


def test_second_turn_prefills_only_the_difference_and_matches_fresh_run():
    engine = tiny_engine("llama", drafter="prompt-lookup")
    first = [{"role": "user", "content": "w10 w11 w12 w13 w14"}]
    ids1, events1 = run(engine, messages=first, sampling=GREEDY, conversation="c")
    reply = "".join(e.text for e in events1)
    second = first + [{"role": "assistant", "content": reply.strip()}, {"role": "user", "content": "w20 w21 w22"}]
    ids2, events2 = run(engine, messages=second, sampling=GREEDY, conversation="c")
    full_prompt_len = events2[-1].stats.prompt_tokens
    prefilled = events2[0].prefill_tokens
    assert prefilled < full_prompt_len
    # Only the new user turn (and the template's closing of the previous reply) is prefilled.
    assert prefilled <= 12
    fresh, _ = run(tiny_engine("llama", drafter="prompt-lookup"), messages=second, sampling=GREEDY)
    assert ids2 == fresh


def test_same_seed_same_sample_and_sampling_reproducible_with_speculation():
    prompt = repetitive_prompt(2)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=30, seed=123)
    a, _ = run(tiny_engine("llama", drafter="prompt-lookup", gamma=3), prompt_ids=prompt, sampling=params)
    b, _ = run(tiny_engine("llama", drafter="prompt-lookup", gamma=3), prompt_ids=prompt, sampling=params)
    assert a == b
    c, _ = run(
        tiny_engine("llama", drafter="prompt-lookup", gamma=3),
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=30, seed=124),
    )
    assert a != c


def test_cancel_between_steps_frees_blocks():
    engine = tiny_engine("llama", drafter="prompt-lookup")
    cancel = threading.Event()
    events = []
    for event in engine.generate(GenerationRequest(prompt_ids=random_ids(20), sampling=GREEDY), cancel):
        events.append(event)
        if len(events) == 3:
            cancel.set()
    assert events[-1].finish_reason == "cancelled"
    assert len([t for e in events for t in e.token_ids]) < 40
    assert engine.blocks_in_use() == 0


def test_context_full_ends_with_context_reason():
    engine = tiny_engine("llama", drafter="none", context_length=48)
    ids, events = run(engine, prompt_ids=random_ids(40), sampling=SamplingParams(temperature=0, max_new_tokens=100))
    assert events[-1].finish_reason == "context"
    assert 40 + len(ids) <= 48


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_settings_name_the_field(bad, field):
    with pytest.raises(RequestError, match=field):  # refused when the settings are built
        SamplingParams(**bad)
    engine = tiny_engine("llama")
    engine.pair = dataclasses.replace(engine.pair, sampling={"temperature": 0.0, **bad})  # a bad pair default
    with pytest.raises(RequestError, match=field):
        list(engine.generate(GenerationRequest(prompt_ids=[5, 6])))


def test_stop_string_ends_reply_without_it():
    prompt = random_ids(20, seed=8)
    plain, events = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=GREEDY)
    text = "".join(e.text for e in events)
    words = text.split()
    stop = words[3]
    _, events = run(
        tiny_engine("llama", drafter="none"),
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0, max_new_tokens=40, stop=(stop,)),
    )
    out = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"
    assert stop not in out and text.startswith(out)


def test_settle_heap_collects_the_garbage_then_freezes_the_rest():
    """After a load, a full collection must not walk the model's objects (0.42 s with the GIL held for the
    embedded default on 2 cores, inside a reply); what was garbage at the load is collected first, not frozen."""
    import gc
    import weakref

    from specchat.backend.engine.engine import settle_heap

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    garbage = weakref.ref(cycle)
    del cycle
    try:
        settle_heap()
        assert garbage() is None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_first_load_freezes_the_imports_and_a_later_load_unfreezes_the_last_one():
    """start_heap: at the first load (nothing frozen) the objects already there go to the permanent generation,
    young garbage collected first, so loading's collections skip them; at a later load what the last load froze
    (a previous engine among it) is unfrozen to be collected."""
    import gc
    import weakref

    from specchat.backend.engine.engine import start_heap

    class Node:
        pass

    gc.unfreeze()
    try:
        cycle = Node()
        cycle.self = cycle
        garbage = weakref.ref(cycle)
        del cycle
        start_heap()
        assert garbage() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0  # the first load froze what was there
        start_heap()
        assert gc.get_freeze_count() == 0  # a later load unfreezes it
    finally:
        gc.unfreeze()


def test_prefill_progress_events_come_only_when_asked_and_change_nothing_else():
    """A request with ``prefill_progress`` gets one event before each prefill pass (tokens read so far of the
    total, no tokens, no statistics); the reply is the same, and a request that does not ask gets none."""
    from specchat.backend.limits import PREFILL_CHUNK

    prompt = random_ids(2 * PREFILL_CHUNK + 40, seed=3)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)
    plain, plain_events = run(tiny_engine("llama", context_length=2048), prompt_ids=prompt, sampling=sampling)
    ids, events = run(
        tiny_engine("llama", context_length=2048), prompt_ids=prompt, sampling=sampling, prefill_progress=True
    )
    progress = [e for e in events if e.prefill_done is not None]
    assert [(e.prefill_done, e.prefill_tokens) for e in progress] == [
        (0, len(prompt)),
        (PREFILL_CHUNK, len(prompt)),
        (2 * PREFILL_CHUNK, len(prompt)),
    ]
    assert events[:3] == progress and events[3].is_prefill  # all before the first token
    assert all(not e.token_ids and e.stats is None and e.finish_reason is None for e in progress)
    assert ids == plain and events[-1].stats.new_tokens == plain_events[-1].stats.new_tokens
    assert all(e.prefill_done is None for e in plain_events)


def test_cancel_while_the_prompt_is_read_stops_before_the_next_pass():
    from specchat.backend.limits import PREFILL_CHUNK

    engine = tiny_engine("llama", context_length=2048)
    cancel = threading.Event()
    request = GenerationRequest(
        prompt_ids=random_ids(3 * PREFILL_CHUNK, seed=4),
        conversation="c",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=5),
        prefill_progress=True,
    )
    events = []
    for event in engine.generate(request, cancel):
        events.append(event)
        if event.prefill_done == PREFILL_CHUNK:
            cancel.set()  # Esc after the first pass
    assert events[-1].finish_reason == "cancelled" and not any(e.token_ids for e in events)
    assert [e.prefill_done for e in events[:-1]] == [0, PREFILL_CHUNK]
    assert len(engine._conversations["c"].cached) == PREFILL_CHUNK  # what was read stays for the next request
