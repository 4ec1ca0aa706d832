"""The engine on the embedded model (SmolLM2-135M-Instruct), against transformers itself.

- the float32 pair (``smollm2-135m-f32``): greedy plain and greedy prompt-lookup output equal transformers
  ``generate()`` greedy, token for token, on chat and code prompts;
- the int4 default (``smollm2-135m``, the GGUF's own 4-bit weights): greedy output is the same for every
  drafter (none, prompt lookup at fixed and adaptive γ, an int4 draft model) on chat, code and edit prompts;
- with speculation forced on (fixed γ = 2, a drafter proposing from a known q), the sampled joint distribution
  of the 2nd and 3rd tokens — the first ones verification decides — matches the target's exact
  probabilities (chi-square; the sample count is in the test);
- the same seed gives the same output.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.models.config import load_pairs
from specchat.backend.models.loading import load_model
from specchat.backend.spec.drafters.base import Draft, StatelessHooks

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CODE = [{"role": "user", "content": "Write a Python function `fib(n)` that returns the n-th Fibonacci number."}]
EDIT = [{"role": "user", "content": (
    "Rename the parameter `xs` to `values` in this function and return the whole function:\n\n"
    "```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n```")}]


@pytest.fixture(scope="module")
def pair():
    return load_pairs()["smollm2-135m-f32"]


@pytest.fixture(scope="module")
def engine(pair):
    target = load_model(pair.target, "cpu")
    return Engine(target, None, pair)


@pytest.fixture(scope="module")
def hf_model(pair):
    return load_model(pair.target, "cpu", attn_implementation="sdpa")


def generate_ids(engine, messages, **kw) -> tuple[list[int], dict]:
    events = list(engine.generate(GenerationRequest(messages=messages, **kw)))
    return [t for e in events for t in e.token_ids], events[-1].stats


@pytest.mark.parametrize("messages", [CHAT, CODE, EDIT], ids=["chat", "code", "edit"])
def test_greedy_plain_and_prompt_lookup_equal_transformers(engine, hf_model, messages):
    n = 40
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)
    with torch.inference_mode():
        out = hf_model.model.generate(**prompt, max_new_tokens=n, do_sample=False)
    reference = out[0, prompt["input_ids"].shape[1]:].tolist()
    greedy = SamplingParams(temperature=0, max_new_tokens=n)
    plain, _ = generate_ids(engine, messages, sampling=greedy, drafter="none")
    lookup, stats = generate_ids(engine, messages, sampling=greedy, drafter="prompt-lookup", gamma=4)
    assert plain == reference
    assert lookup == reference
    if messages is EDIT:  # the reply copies the function: prompt lookup must have found drafts
        assert stats.drafted > 0 and stats.accepted > 0


@pytest.fixture(scope="module")
def int4_engine():
    pair = load_pairs()["smollm2-135m"]
    assert pair.target.quantization == "int4-torch"
    target = load_model(pair.target, "cpu")
    twin = dataclasses.replace(pair, name="int4-twin", drafter="draft-model", draft=pair.target)
    engine = Engine(target, load_model(pair.target, "cpu"), twin)
    assert engine.runner.path == "cpu-compact"
    return engine


@pytest.mark.parametrize("messages", [CHAT, CODE, EDIT], ids=["chat", "code", "edit"])
def test_int4_default_greedy_output_is_the_same_for_every_drafter(int4_engine, messages):
    greedy = SamplingParams(temperature=0, max_new_tokens=48)
    plain, _ = generate_ids(int4_engine, messages, sampling=greedy, drafter="none")
    for drafter, gamma in [("prompt-lookup", 4), ("prompt-lookup", "auto"), ("draft-model", 3)]:
        ids, stats = generate_ids(int4_engine, messages, sampling=greedy, drafter=drafter, gamma=gamma)
        assert ids == plain, (drafter, gamma)
        if drafter == "draft-model":  # the twin proposes what the target decides: verification took many at once
            assert stats.accepted > 0
    assert "Paris" in int4_engine.tokenizer.decode(plain) or messages is not CHAT


class UniformDrafter(StatelessHooks):
    """Proposes 2 tokens drawn uniformly from a candidate set, with q = that uniform distribution."""

    name = "prompt-lookup"

    def __init__(self, candidates: list[int], vocab: int, seed: int = 0):
        self.candidates = candidates
        self.q = torch.zeros(vocab)
        self.q[candidates] = 1.0 / len(candidates)
        self.rng = random.Random(seed)

    def reset(self):
        pass

    def observe(self, n):
        pass

    def propose(self, context, max_tokens):
        ids = [self.rng.choice(self.candidates) for _ in range(max_tokens)]
        return Draft(token_ids=ids, probs=self.q.expand(len(ids), -1).clone())


def test_rejection_sampling_keeps_the_target_distribution_on_the_real_model(engine):
    """Top-k 2 at temperature 1: tokens 1-3 each have two choices, so (t2, t3) has at most 4 cells whose exact
    probabilities come from 7 target forwards. 300 samples, chi-square at p > 0.001."""
    messages = [{"role": "user", "content": "Say something."}]
    tok = engine.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    def top2(prefix):  # exact warped distribution after `prefix` (temperature 1, top-k 2)
        logits = _full_forward(engine, prefix)
        p = torch.softmax(logits, -1)
        vals, idx = p.topk(2)
        return {int(i): float(v / vals.sum()) for v, i in zip(vals, idx)}

    exact: dict[tuple[int, int], float] = {}
    candidates: set[int] = set()
    for t1, p1 in top2(prompt).items():
        for t2, p2 in top2(prompt + [t1]).items():
            for t3, p3 in top2(prompt + [t1, t2]).items():
                exact[(t2, t3)] = exact.get((t2, t3), 0.0) + p1 * p2 * p3
                candidates.update((t2, t3))
    junk = next(t for t in range(100, 200) if t not in candidates)  # always rejected: exercises the residual
    original = engine.drafters["prompt-lookup"]
    engine.drafters["prompt-lookup"] = UniformDrafter(sorted(candidates) + [junk], engine.vocab_limit)
    counts: dict[tuple[int, int], int] = {}
    samples = 300
    drafted = 0
    try:
        for s in range(samples):
            ids, stats = generate_ids(engine, messages, drafter="prompt-lookup", gamma=2, conversation="chi2",
                                      sampling=SamplingParams(temperature=1.0, top_k=2, max_new_tokens=4, seed=s))
            key = (ids[1], ids[2])
            counts[key] = counts.get(key, 0) + 1
            drafted += stats.drafted
    finally:
        engine.drafters["prompt-lookup"] = original
        engine.forget("chi2")
    assert drafted >= 2 * samples  # every sample verified a 2-token draft
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - samples * p) ** 2 / (samples * p) for k, p in exact.items())
    dof = len(exact) - 1
    # Wilson-Hilferty approximation of the chi-square quantile at 0.999.
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, f"chi2={chi2:.1f} (dof {dof}, limit {limit:.1f}); counts {counts}, exact {exact}"


def _full_forward(engine, ids: list[int]) -> torch.Tensor:
    """Last-position logits over the tokenizer's ids, computed through a scratch request's prefill path."""
    from specchat.backend.engine.runner import forward_paged

    seq = engine.cache.new_sequence()
    try:
        return forward_paged(engine.target.model, seq, ids, logits_to_keep=1)[0, : engine.vocab_limit].float()
    finally:
        seq.free()


def test_same_seed_same_sample(engine):
    params = dict(sampling=SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=7),
                  drafter="prompt-lookup", gamma=3)
    a, _ = generate_ids(engine, CODE, **params)
    b, _ = generate_ids(engine, CODE, **params)
    assert a == b
