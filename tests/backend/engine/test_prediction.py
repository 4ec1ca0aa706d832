"""A prediction (GenerationRequest.prediction, issue 35) never changes the reply, and its counts add up.

On tiny random-weight models with the word-level tokenizer (one word per id, so a prediction's text tokenises to
exactly the ids it was written from): greedy and seeded replies are the same with and without a prediction that
matches the reply, diverges and rejoins it (a word changed, one inserted, one left out), is empty, runs past the
reply's end, or holds the stop text; each with the request's own drafter none or prompt-lookup. The usage counts:
accepted + rejected prediction tokens = the tokens the prediction drafter had verified; a prediction equal to
the reply is never rejected; the counts are None without a prediction. The drafter's rules are the worked
examples of its docstring (run here), and a few more cases.
"""

from __future__ import annotations

import doctest

import pytest
from engine_fixtures import tiny_engine, tiny_tokenizer
from tiny_models import one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, PolicyState, SamplingParams
from specchat.backend.errors import RequestError
from specchat.backend.limits import MAX_GAMMA, MAX_PREDICTION_GAMMA
from specchat.backend.speculative.drafters import prediction as prediction_module
from specchat.backend.speculative.drafters.prediction import PredictionDrafter

SAMPLED = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1)


def run(engine, **kw):
    events = list(engine.generate(GenerationRequest(**kw)))
    return [t for e in events for t in e.token_ids], events


TOKENIZER = tiny_tokenizer()


def words(ids: list[int]) -> str:
    """The tiny tokenizer's text for ``ids`` (EOS left out: a prediction is text); it tokenises back to them."""
    return " ".join(TOKENIZER.convert_ids_to_tokens([i for i in ids if i != 2]))


def variants(reply: list[int]) -> dict[str, str]:
    """Predictions of ``reply``: equal, diverging and rejoining, empty, too long, ..."""
    body = [t for t in reply if t != 2]
    third, half = len(body) // 3, len(body) // 2
    return {
        "equal": words(body),
        "changed word": words(body[:third] + [99] + body[third + 1 :]),
        "inserted word": words(body[:third] + [98, 97] + body[third:]),
        "left out": words(body[:third] + body[third + 3 :]),
        "two edits": words(body[:third] + [96] + body[third + 1 : half] + body[half + 2 :]),
        "empty": "",
        "longer": words(body + random_ids(30, seed=9)),
        "unrelated": words(random_ids(40, seed=11)),
    }


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(SAMPLED, seed=2024)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "auto"])
def test_a_prediction_never_changes_the_reply(sampling, drafter):
    engine = tiny_engine("llama", drafter="none")
    params = SamplingParams(**sampling, max_new_tokens=60)
    prompt, plain = long_reply(engine, 3, params)
    # Where the prediction has no match the request's own drafter serves: with an empty one, a fixed drafter
    # drafts as without a prediction; auto picks among its candidates per step from measured
    # times (so its picks may differ between runs), and they still draft. Fresh engines: the γ policies and the
    # reply memory learn across requests.
    drafted = []
    for prediction in (None, ""):
        fresh = tiny_engine("llama", drafter="none")
        _, events = run(fresh, prompt_ids=prompt, sampling=params, drafter=drafter, prediction=prediction)
        drafted.append([(e.drafter, e.gamma) for e in events if e.gamma])
    assert (drafter == "none") == (not drafted[0]) == (not drafted[1])
    assert "prediction" not in {name for name, _ in drafted[1]}
    # γ follows measured times (backend/speculative/policy.py), so only who drafted is compared
    assert drafter in ("auto", "none") or {name for name, _ in drafted[0]} == {name for name, _ in drafted[1]} == {
        drafter
    }
    accepted = 0
    for name, text in variants(plain).items():
        ids, events = run(engine, prompt_ids=prompt, sampling=params, drafter=drafter, prediction=text)
        assert ids == plain, name
        stats = events[-1].stats
        assert stats.prediction_tokens == len(text.split())
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == sum(
            e.gamma for e in events if e.drafter == "prediction"
        )
        assert stats.accepted_prediction_tokens <= stats.new_tokens
        accepted += stats.accepted_prediction_tokens
        if name == "equal":
            assert stats.rejected_prediction_tokens == 0 and stats.accepted_prediction_tokens > len(plain) // 2
            assert stats.drafter == "prediction" and stats.steps < len(plain) // 4
    assert accepted > 0


def long_reply(engine, prompt_seed: int, sampling: SamplingParams) -> tuple[list[int], list[int]]:
    """A prompt whose reply runs to ``sampling.max_new_tokens`` (no EOS on the way), and that reply."""
    for seed in range(prompt_seed, prompt_seed + 50):
        prompt = random_ids(16, seed=seed)
        plain, _ = run(engine, prompt_ids=prompt, sampling=sampling, drafter="none")
        if len(plain) == sampling.max_new_tokens:
            return prompt, plain
    raise AssertionError("no prompt found whose reply runs to the limit")


def test_drafts_are_capped_at_the_rows_the_path_verifies_exactly():
    """A perfect prediction drafts at most MAX_GAMMA tokens per pass on a path held to MAX_GAMMA + 1 rows (this
    eager float model), and MAX_PREDICTION_GAMMA = 63 on the compact forward (int4 on CPU: 64 rows attended
    row by row, tests/backend/kernels/test_compact.py), with the same reply as plain decoding."""
    engine = tiny_engine("llama", drafter="none", context_length=512)
    prompt, plain = long_reply(engine, 5, SamplingParams(temperature=0, max_new_tokens=200))
    ids, events = run(
        engine, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_new_tokens=200), prediction=words(plain)
    )
    assert ids == plain
    assert engine.runner.exact_rows == MAX_GAMMA + 1 and max(e.gamma for e in events) == MAX_GAMMA
    compact = compact_engine()
    assert compact.runner.path == "cpu-compact" and compact.runner.exact_rows == MAX_PREDICTION_GAMMA + 1
    prompt, _ = long_reply(compact, 5, SamplingParams(temperature=0, max_new_tokens=200))
    for sampling in (SamplingParams(temperature=0, max_new_tokens=200), SamplingParams(**SAMPLED, seed=7)):
        plain, _ = run(compact, prompt_ids=prompt, sampling=sampling, drafter="none")
        ids, events = run(compact, prompt_ids=prompt, sampling=sampling, drafter="none", prediction=words(plain))
        assert ids == plain
        assert max(e.gamma for e in events) == MAX_PREDICTION_GAMMA or len(plain) < 100


def compact_engine():
    """An engine over a tiny int4 llama on CPU: the compact forward's path (the embedded default's)."""
    import dataclasses

    from engine_fixtures import tiny_loaded, tiny_pair
    from tiny_models import quantised_paged

    from specchat.backend.engine.engine import Engine

    loaded = dataclasses.replace(tiny_loaded("llama"), model=quantised_paged("llama", head_dim=32))
    return Engine(loaded, None, tiny_pair(drafter="none", context_length=512))


def test_a_stop_text_inside_the_prediction_ends_the_reply_where_plain_decoding_does():
    engine = tiny_engine("llama", drafter="none")
    prompt = random_ids(20, seed=8)
    full, events = run(engine, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_new_tokens=50))
    stop_word = "".join(e.text for e in events).split()[12]
    stop = SamplingParams(temperature=0, max_new_tokens=50, stop=(stop_word,))
    plain, plain_events = run(engine, prompt_ids=prompt, sampling=stop, drafter="none")
    ids, events = run(engine, prompt_ids=prompt, sampling=stop, drafter="none", prediction=words(full))
    assert ids == plain and events[-1].finish_reason == plain_events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == "".join(e.text for e in plain_events)
    stats = events[-1].stats
    assert stats.accepted_prediction_tokens <= stats.new_tokens == plain_events[-1].stats.new_tokens
    # The drafts that ran past the stop text were accepted by the target but are not in the reply: rejected.
    assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == sum(
        e.gamma for e in events if e.drafter == "prediction"
    )


def test_without_a_prediction_the_counts_are_none_and_the_states_stay_honest():
    engine = tiny_engine("llama", drafter="none")
    prompt = random_ids(20, seed=1)
    _, events = run(engine, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_new_tokens=20))
    stats = events[-1].stats
    assert stats.prediction_tokens is stats.accepted_prediction_tokens is stats.rejected_prediction_tokens is None
    assert {e.policy for e in events} == {PolicyState.OFF}
    # An unrelated prediction and no other drafter: the steps it cannot draft are NO_DRAFT, not OFF.
    _, events = run(
        engine,
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0, max_new_tokens=20),
        prediction=words(random_ids(10, seed=40)),
    )
    assert all(e.policy in (PolicyState.NO_DRAFT, PolicyState.SPECULATING) for e in events)
    as_json = events[-1].stats.to_json_stats()
    assert as_json["accepted_prediction_tokens"] is not None and as_json["rejected_prediction_tokens"] is not None


@pytest.mark.parametrize("bad", [3, b"text", "x" * ((1 << 22) + 1)])
def test_a_bad_prediction_is_refused_by_name(bad):
    with pytest.raises(RequestError, match="prediction"):
        GenerationRequest(prompt_ids=[1, 2], prediction=bad)


def test_the_worked_examples_of_the_docstring():
    assert doctest.testmod(prediction_module).failed == 0


def test_length_grows_on_whole_acceptance_and_drops_at_once_on_a_miss():
    p = PredictionDrafter(list(range(100, 300)), start_tokens=4, min_tokens=2, max_tokens=20)
    p.configure(None, reply_start=0)
    context = [100]
    lengths = []
    for accepted_all in (True, True, True, True, False, True):
        draft = p.propose(context, 64).token_ids
        lengths.append(len(draft))
        if accepted_all:
            p.observe(len(draft))
            context += draft + [draft[-1] + 1]  # every draft accepted, then the bonus token
        else:
            p.observe(1)
            context += draft[:1] + [draft[1] + 1]  # one accepted, then the target skipped one: a miss
    assert lengths == [4, 8, 16, 20, 20, 2]  # the last one from right after the skip (a rejoin near the anchor)
    assert p.propose(context, 1).token_ids == [context[-1] + 1]  # the caller's cap


def test_rejoin_after_an_inserted_line_and_a_renamed_word():
    line = [10, 11, 12, 1]  # a line ending in a line break (1)
    prediction = line + [20, 21, 1] + [30, 31, 32, 1] + [20, 22, 1]
    p = PredictionDrafter(prediction, start_tokens=8, min_tokens=2)
    p.configure(None, reply_start=0)
    assert p.propose([10], 8).token_ids == prediction[1:9]
    p.observe(2)  # up to the first line break accepted, then the reply inserted a line of its own
    reply = line + [77]
    assert p.propose(reply, 8).token_ids == []  # 77 is not in the prediction
    reply += [78, 1]  # the inserted line ends: the line break before the anchor is the nearest rejoin
    assert p.propose(reply, 8).token_ids == [20, 21]
    p.observe(2)
    reply += [20, 21, 1, 30, 99]  # 99 replaces 31 (a rename)
    assert p.propose(reply, 8).token_ids == []
    reply += [32]  # "32" follows the old word: drafting goes on after it
    assert p.propose(reply, 8).token_ids == [1, 20, 22, 1]
    assert p.rejoins == 2


def test_a_context_that_did_not_grow_from_the_last_one_starts_over():
    p = PredictionDrafter([5, 6, 7, 8, 9], start_tokens=2, min_tokens=1)
    p.configure(None, reply_start=2)
    assert p.propose([0, 0, 5, 6], 9).token_ids == [7, 8]
    assert p.propose([0, 0, 5], 9).token_ids == [6, 7]  # shorter: a new reply from the start


def test_a_failing_prediction_ends_nothing_but_itself(monkeypatch):
    engine = tiny_engine("llama", drafter="none")
    params = SamplingParams(temperature=0, max_new_tokens=30)
    prompt, plain = long_reply(engine, 1, params)

    def broken(self, context, max_tokens):
        raise IndexError("bad index")

    monkeypatch.setattr(PredictionDrafter, "propose", broken)
    ids, events = run(engine, prompt_ids=prompt, sampling=params, drafter="prompt-lookup", prediction=words(plain))
    assert ids == plain and events[-1].finish_reason == "length"
    assert sum("The prediction failed (IndexError: bad index)" in (e.message or "") for e in events) == 1
