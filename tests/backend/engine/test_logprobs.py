"""A request's logprobs (issue 46): each token's log-probability under the row that decided it and the k likeliest
ids, the same with and without speculation (every drafter, γ, a constraint). These tiny models run transformers'
forward, whose rows may round differently by the pass's size (docs/determinism.md), so the figures are compared to
1e-5; the native model's rows, and so its logprobs, are the same bits in every pass."""

from __future__ import annotations

import math

import pytest
from char_tokenizer import char_engine
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.backend.api import ConstraintSpec, GenerationRequest, SamplingParams
from specchat.backend.errors import RequestError

MESSAGES = [{"role": "user", "content": "abc abc abc abc"}]


def close(a: list[dict], b: list[dict]) -> bool:
    def key(items):
        return [(x["id"], x["token"], [(t, i) for t, i, _ in x["top"]]) for x in items]

    figures = [(x["logprob"], y["logprob"]) for x, y in zip(a, b)]
    figures += [(p, q) for x, y in zip(a, b) for (_, _, p), (_, _, q) in zip(x["top"], y["top"])]
    return key(a) == key(b) and all(abs(p - q) <= 1e-5 for p, q in figures)


def run(engine, **kw):
    request = GenerationRequest(messages=MESSAGES, sampling=SamplingParams(max_new_tokens=24, **kw.pop("s")), **kw)
    events = list(engine.generate(request))
    return [t for e in events for t in e.token_ids], [x for e in events for x in e.logprobs or []]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3, "repetition_penalty": 1.3}])
def test_logprobs_do_not_depend_on_speculation(sampling):
    engine = char_engine(draft=True)
    ids, plain = run(engine, s=sampling, drafter="none", logprobs=3)
    assert len(plain) == len(ids) and [x["id"] for x in plain] == ids
    for item in plain:
        assert item["logprob"] <= 0 and len(item["top"]) == 3
        assert item["top"][0][2] >= item["top"][1][2] >= item["top"][2][2]
        assert sum(math.exp(lp) for _, _, lp in item["top"]) <= 1 + 1e-9
    for drafter, gamma in (("prompt-lookup", 4), ("draft-model", 8), ("suffix", 2), ("auto", "auto")):
        again, other = run(engine, s=sampling, drafter=drafter, gamma=gamma, logprobs=3)
        assert again == ids and close(other, plain), drafter
    spec = ConstraintSpec("regex", "[a-c ]{5,20}")
    _, masked = run(engine, s=sampling, drafter="none", logprobs=0, constraint=spec)
    _, masked_spec = run(engine, s=sampling, drafter="draft-model", gamma=4, logprobs=0, constraint=spec)
    assert close(masked, masked_spec) and all(not x["top"] for x in masked)


def test_no_logprobs_unless_asked_and_the_range_is_checked():
    engine = char_engine(drafter="none")
    assert run(engine, s={"temperature": 0})[1] == []
    with pytest.raises(RequestError, match="logprobs"):
        GenerationRequest(messages=MESSAGES, logprobs=21)
