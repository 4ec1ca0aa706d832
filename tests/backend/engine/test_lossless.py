"""Speculation never changes the reply, under every setting (issue 14), on tiny random-weight models.

- greedy with a repetition penalty: plain equals transformers generate() with the same penalty, and prompt
  lookup, the draft model and auto equal plain, per family (the penalty's context in a verification pass);
- sampled (temperature 0.8, top-p 0.95, penalty 1.1, a fixed seed): the same tokens for none, prompt-lookup,
  draft-model and auto at γ 1, 4, 16 and auto, per family (the target's Gumbel-max choice keyed by reply position);
- a stop string ending a reply inside a speculative step: the same token ids and counts as plain decoding;
- step states: a step without a draft is NO_DRAFT unless the policy paused (nothing found, the last token, the
  KV cache full), never "speculating" or "paused";
- prefill asks for one logits row; the draft model applies the penalty (a twin accepts everything) and keeps
  its cache across a chat turn (counted as reused), prefilling in chunks;
- the seed: drawn and reported when absent, and the reported seed replays the reply;
- the smallest temperature a request may give is greedy on loud logits, the smallest penalty is transformers'
  own, never NaN garbage; values below them are refused naming the field.
"""

from __future__ import annotations

import pytest
from engine_fixtures import hf_greedy, tiny_engine, tiny_loaded, tiny_pair
from tiny_models import FAMILIES, one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, PolicyState, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.errors import RequestError
from specchat.backend.limits import MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from specchat.backend.speculative.drafters.base import Draft, StatelessHooks

SAMPLED = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1)


def run(engine, **kw):
    events = list(engine.generate(GenerationRequest(**kw)))
    return [t for e in events for t in e.token_ids], events


def repetitive_prompt(seed: int = 0) -> list[int]:
    base = random_ids(12, seed=seed)
    return base * 3 + base[:5]


class ScriptedDrafter(StatelessHooks):
    """Proposes a fixed function of the context (forcing long accepted runs, or nothing)."""

    name = "prompt-lookup"

    def __init__(self, fn):
        self.fn = fn

    def propose(self, context, max_tokens):
        return Draft(token_ids=self.fn(list(context))[:max_tokens])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("penalty", [1.5, 1.05])
def test_greedy_with_a_penalty_equals_transformers_for_every_drafter(family, penalty):
    """On the old code the verification rows saw the context minus its last γ tokens (the pending one
    included): prompt lookup gave other tokens than plain decoding at penalty 1.5."""
    prompt = repetitive_prompt(3)
    greedy = SamplingParams(temperature=0, repetition_penalty=penalty, max_new_tokens=30)
    engine = tiny_engine(family, drafter="none", draft_family=family, draft_seed=1, gamma=4)
    plain, _ = run(engine, prompt_ids=prompt, sampling=greedy, drafter="none")
    assert plain == hf_greedy(family, prompt, 30, repetition_penalty=penalty)
    drafted = 0
    for drafter in ("prompt-lookup", "draft-model", "auto"):
        ids, events = run(engine, prompt_ids=prompt, sampling=greedy, drafter=drafter)
        assert ids == plain, drafter
        drafted += events[-1].stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_seed_gives_the_same_tokens_for_every_drafter_and_gamma(family):
    """Temperature 0.8, top-p 0.95, penalty 1.1, seed 2024: none, prompt-lookup, draft-model and auto at γ 1, 4,
    16 and auto emit the same 40 tokens (drafts accepted and rejected along the way). On the old code the random
    draws depended on the drafts."""
    prompt = repetitive_prompt(2)
    engine = tiny_engine(family, drafter="none", draft_family=family, draft_seed=1, gamma="auto")
    params = SamplingParams(**SAMPLED, max_new_tokens=40, seed=2024)
    plain, events = run(engine, prompt_ids=prompt, sampling=params, drafter="none")
    assert events[-1].stats.seed == 2024
    accepted = rejected = 0
    for drafter in ("prompt-lookup", "draft-model", "auto"):
        for gamma in (1, 4, 16, "auto"):
            ids, events = run(engine, prompt_ids=prompt, sampling=params, drafter=drafter, gamma=gamma)
            assert ids == plain, (drafter, gamma)
            stats = events[-1].stats
            accepted += stats.accepted
            rejected += stats.drafted - stats.accepted
    assert accepted > 0 and rejected > 0
    other, _ = run(engine, prompt_ids=prompt, sampling=SamplingParams(**SAMPLED, max_new_tokens=40, seed=2025))
    assert other != plain


def test_stop_string_inside_a_speculative_step_reports_what_plain_decoding_does():
    """A perfect drafter proposes 6 tokens; the stop string ends in the 2nd: the accepted tokens after it must not
    stay in token_ids, new_tokens or tok_s (the old code kept them: --json differed from plain decoding)."""
    prompt = random_ids(16, seed=8)
    greedy = SamplingParams(temperature=0, max_new_tokens=30)
    full, events = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=greedy)
    words = "".join(e.text for e in events).split()
    stop = SamplingParams(temperature=0, max_new_tokens=30, stop=(words[3],))
    plain, plain_events = run(tiny_engine("llama", drafter="none"), prompt_ids=prompt, sampling=stop)
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=6)
    engine.drafters["prompt-lookup"] = ScriptedDrafter(lambda ctx: full[len(ctx) - len(prompt) :])
    ids, events = run(engine, prompt_ids=prompt, sampling=stop)
    assert plain_events[-1].finish_reason == events[-1].finish_reason == "stop"
    assert ids == plain and len(ids) < len(full)
    assert events[-1].stats.new_tokens == plain_events[-1].stats.new_tokens == len(plain)
    assert "".join(e.text for e in events) == "".join(e.text for e in plain_events)
    assert all(len(e.token_ids) == len(e.token_texts) == len(e.sources) for e in events)
    assert events[-1].stats.accepted > 0


def test_steps_without_a_draft_are_not_called_speculating_or_paused():
    """Prompt lookup finding nothing (a prompt without repeats) and the last step with one token left verify no
    draft and the policy did not pause: NO_DRAFT (the old code said SPECULATING at γ 0, and PAUSED)."""
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=4)
    engine.drafters["prompt-lookup"] = ScriptedDrafter(lambda ctx: [] if len(ctx) % 3 else [ctx[-1]] * 4)
    _, events = run(engine, prompt_ids=list(range(10, 40)), sampling=SamplingParams(temperature=0, max_new_tokens=25))
    states = {(e.gamma > 0, e.policy) for e in events[1:]}
    assert states <= {(True, PolicyState.SPECULATING), (False, PolicyState.NO_DRAFT)}, states
    assert (False, PolicyState.NO_DRAFT) in states and events[0].policy is PolicyState.NO_DRAFT
    stats = events[-1].stats
    assert stats.spec_paused_steps == 0 and stats.no_draft_steps == sum(e.gamma == 0 for e in events[1:]) > 0
    # max_new_tokens 2: the only step has one token left, so it drafts nothing; the policy did not pause.
    _, events = run(engine, prompt_ids=repetitive_prompt(), sampling=SamplingParams(temperature=0, max_new_tokens=2))
    assert [e.policy for e in events[1:]] == [PolicyState.NO_DRAFT]
    # No drafter at all: OFF.
    _, events = run(
        engine, prompt_ids=repetitive_prompt(), drafter="none", sampling=SamplingParams(temperature=0, max_new_tokens=4)
    )
    assert {e.policy for e in events} == {PolicyState.OFF}


def test_kv_full_fallback_is_a_no_draft_step():
    """The KV pool cannot hold the draft: the step runs plain, NO_DRAFT (the old code called it PAUSED)."""
    prompt = (random_ids(12) * 4)[:43]  # 43 tokens in a pool of 48: a draft of 6 does not fit, one token does
    plain, _ = run(
        tiny_engine("llama", drafter="none", kv_tokens=48),
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0, max_new_tokens=100),
    )
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=6, kv_tokens=48)
    engine.drafters["prompt-lookup"] = ScriptedDrafter(lambda ctx: plain[len(ctx) - len(prompt) :])
    ids, events = run(engine, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_new_tokens=100))
    assert ids == plain[: len(ids)] and events[-1].finish_reason == "context"
    fallback = [e for e in events[1:] if e.gamma == 0 and e.token_ids]
    assert fallback and all(e.policy is PolicyState.NO_DRAFT for e in fallback)
    assert events[-1].stats.spec_paused_steps == 0


def test_prefill_keeps_one_logits_row():
    """The old prefill asked for a row per prompt token (512 x vocab floats per chunk, plus a penalised copy)."""
    engine = tiny_engine("llama", drafter="none")
    calls = []
    forward = engine.runner.forward

    def spy(seq, ids, *, logits_to_keep=1, parents=None, **options):
        calls.append((len(ids), logits_to_keep))
        return forward(seq, ids, logits_to_keep=logits_to_keep, parents=parents, **options)

    engine.runner.forward = spy
    run(
        engine,
        prompt_ids=random_ids(60),
        sampling=SamplingParams(temperature=0.7, repetition_penalty=1.3, max_new_tokens=3, seed=1),
    )
    assert calls[0] == (60, 1) and all(keep == 1 for _, keep in calls)


def test_draft_model_applies_the_penalty():
    """A draft identical to the target must be accepted every time at penalty 1.5 (the old draft ignored the
    penalty: 13 of 58 drafts accepted on the embedded default)."""
    engine = tiny_engine("llama", drafter="draft-model", draft_family="llama", gamma=4)
    for sampling in (
        SamplingParams(temperature=0, repetition_penalty=1.5, max_new_tokens=40),
        SamplingParams(**SAMPLED, max_new_tokens=40, seed=3),
    ):
        _, events = run(engine, prompt_ids=repetitive_prompt(2), sampling=sampling)
        stats = events[-1].stats
        assert stats.drafted > 20 and stats.accepted == stats.drafted, sampling


def test_draft_model_cache_survives_a_chat_turn_and_prefills_in_chunks():
    engine = tiny_engine("llama", drafter="draft-model", draft_family="llama", draft_seed=1, gamma=3)
    drafter = engine.drafters["draft-model"]
    drafter.prefill_chunk = 8
    fed = []
    forward = drafter.forward

    def spy(seq, ids, *, logits_to_keep=1):
        fed.append(len(ids))
        return forward(seq, ids, logits_to_keep=logits_to_keep)

    drafter.forward = spy
    first = [{"role": "user", "content": " ".join(f"w{i}" for i in range(10, 40))}]
    _, events = run(engine, messages=first, conversation="c", sampling=SamplingParams(temperature=0, max_new_tokens=8))
    stats = events[-1].stats
    assert stats.draft_reused_tokens == 0 and stats.draft_prefill_tokens == stats.prompt_tokens + 1
    assert max(fed) == 8  # chunks of at most prefill_chunk ids
    reply = "".join(e.text for e in events).strip()
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "w50 w51"}]
    fed.clear()
    _, events = run(engine, messages=second, conversation="c", sampling=SamplingParams(temperature=0, max_new_tokens=8))
    stats = events[-1].stats
    assert stats.draft_reused_tokens >= 30 and stats.draft_prefill_tokens < 20  # only the new turn is read
    assert sum(fed) < stats.prompt_tokens


def test_the_seed_is_drawn_reported_and_replays_the_reply():
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=3)
    params = SamplingParams(**SAMPLED, max_new_tokens=20)
    a, events_a = run(engine, prompt_ids=repetitive_prompt(4), sampling=params)
    b, events_b = run(engine, prompt_ids=repetitive_prompt(4), sampling=params)
    seed_a, seed_b = events_a[-1].stats.seed, events_b[-1].stats.seed
    assert isinstance(seed_a, int) and 0 <= seed_a < 2**53 and seed_a != seed_b
    assert all(e.stats.seed == seed_a for e in events_a)
    again, _ = run(
        engine,
        prompt_ids=repetitive_prompt(4),
        drafter="none",
        sampling=SamplingParams(**SAMPLED, max_new_tokens=20, seed=seed_a),
    )
    assert again == a


def loud_engine(drafter: str, gamma="auto"):
    """A tiny engine whose logits reach tens, as real models' do (the tiny ones stay within a few units); the
    output head is scaled before the engine packs the weights."""
    target = tiny_loaded("llama")
    target.model.lm_head.weight.data *= 40
    return Engine(target, None, tiny_pair(drafter=drafter, gamma=gamma))


@pytest.mark.parametrize(
    ("temperature", "penalty"), [(MIN_TEMPERATURE, None), (MIN_TEMPERATURE, MIN_REPETITION_PENALTY)]
)
def test_tiny_temperatures_are_greedy_through_the_engine(temperature, penalty):
    """The old engine divided logits by the temperature: a tiny one (or one after a tiny penalty multiplied
    them) overflowed to NaN probabilities, and it emitted the last token id for every position. The smallest
    values a request may give decode as greedy does; smaller ones are refused (backend/limits.py)."""
    for field, value in (("temperature", 1e-38), ("repetition_penalty", 1e-30)):
        with pytest.raises(RequestError, match=field):
            SamplingParams(**{field: value})
    prompt = repetitive_prompt(5)
    greedy, _ = run(
        loud_engine("none"),
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0, repetition_penalty=penalty, max_new_tokens=30),
    )
    assert len(set(greedy)) > 3
    for drafter in ("none", "prompt-lookup"):
        ids, _ = run(
            loud_engine(drafter, gamma=4),
            prompt_ids=prompt,
            sampling=SamplingParams(
                temperature=temperature, top_p=0.9, repetition_penalty=penalty, max_new_tokens=30, seed=1
            ),
        )
        assert ids == greedy, drafter


def test_a_tiny_repetition_penalty_is_transformers_own():
    prompt = repetitive_prompt(6)
    greedy = SamplingParams(temperature=0, repetition_penalty=MIN_REPETITION_PENALTY, max_new_tokens=20)
    for drafter in ("none", "prompt-lookup"):
        ids, _ = run(tiny_engine("llama", drafter=drafter, gamma=4), prompt_ids=prompt, sampling=greedy)
        assert ids == hf_greedy("llama", prompt, 20, repetition_penalty=MIN_REPETITION_PENALTY), drafter
    ids, events = run(
        loud_engine("prompt-lookup", gamma=4),
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0.7, repetition_penalty=MIN_REPETITION_PENALTY, max_new_tokens=20, seed=2),
    )
    assert len(ids) == 20 and events[-1].finish_reason == "length"
