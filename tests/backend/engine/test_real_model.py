"""The engine on the embedded default model (SmolLM2-135M-Instruct), against transformers itself.

The engine is the ``smollm2-135m-nf4-draft`` pair's: the embedded target, prompt lookup, and a bitsandbytes nf4
copy of the target as draft model (its own distribution, so drafts are accepted and rejected), through
transformers' forward (``SPECCHAT_NATIVE=0``; the CPU native model runs the default in test_native_default.py).

- greedy, without a penalty and with repetition penalty 1.3 and 1.05: plain decoding equals transformers
  ``generate()`` with the same penalty, token for token, on chat and code prompts, and prompt lookup, the draft
  model and auto equal plain (issue 14, defect 1);
- temperature 0.8, top-p 0.95, penalty 1.1 and a fixed seed: the same tokens for none, prompt-lookup,
  draft-model and auto at γ 1, 4, 16 and auto (issue 14: the target's Gumbel-max choice keyed by reply
  position);
- with speculation forced on (γ 2, a drafter proposing at random among the likely tokens and one never
  accepted), the sampled joint distribution of the 2nd and 3rd tokens — the first ones verification decides —
  matches the target's exact probabilities at temperature 0.7, top-k 2 and penalty 1.3, computed with
  transformers' own forward and processors (chi-square; the sample count is in the test);
- the int4 default through the compact forward (``smollm2-135m``, the GGUF's own 4-bit weights: the fallback
  where the CPU native model cannot be built): greedy output is the same for every drafter (none, prompt lookup
  at fixed and adaptive γ, suffix trees, an int4 draft model) on chat, code and edit prompts.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine, load_engine
from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.loading.pair import load_model
from specchat.backend.speculative.drafters.base import Draft, StatelessHooks

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CODE = [{"role": "user", "content": "Write a Python function `fib(n)` that returns the n-th Fibonacci number."}]
EDIT = [
    {
        "role": "user",
        "content": (
            "Rename the parameter `xs` to `values` in this function and return the whole function:\n\n"
            "```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
            "    return total / len(xs)\n```"
        ),
    }
]
DRAFTERS = ("prompt-lookup", "draft-model", "auto")


@pytest.fixture(scope="module")
def pair():
    return load_pairs()["smollm2-135m-nf4-draft"]


@pytest.fixture(scope="module")
def engine(pair):
    # These tests hold the engine to transformers' own generate() token for token: the transformers path (the
    # CPU native model's logits differ from transformers' in the last bits: test_native_default.py tests it).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECCHAT_NATIVE", "0")
        engine = load_engine(pair, device="cpu")
    assert engine.runner.path != "cpu-native"
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(pair):
    return load_model(pair.target, "cpu", attn_implementation="sdpa").model


def generate_ids(engine, messages, **kw) -> tuple[list[int], object]:
    events = list(engine.generate(GenerationRequest(messages=messages, **kw)))
    return [t for e in events for t in e.token_ids], events[-1].stats


def prompt_ids(engine, messages) -> list[int]:
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


@pytest.mark.parametrize(
    ("messages", "penalty"),
    [(CHAT, None), (CODE, None), (EDIT, None), (CHAT, 1.3), (CODE, 1.3), (CHAT, 1.05), (CODE, 1.05)],
    ids=["chat", "code", "edit", "chat-1.3", "code-1.3", "chat-1.05", "code-1.05"],
)
def test_greedy_equals_transformers_for_every_drafter(engine, hf_model, messages, penalty):
    """On bcb0966 prompt lookup with penalty 1.3 gave other tokens than plain decoding (the verification rows'
    penalty context lacked the last γ committed tokens)."""
    n = 40
    prompt = prompt_ids(engine, messages)
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            repetition_penalty=penalty,
        )
    reference = out[0, len(prompt) :].tolist()
    greedy = SamplingParams(temperature=0, repetition_penalty=penalty, max_new_tokens=n)
    plain, _ = generate_ids(engine, messages, sampling=greedy, drafter="none")
    assert plain == reference
    drafted = 0
    for drafter in DRAFTERS:
        ids, stats = generate_ids(engine, messages, sampling=greedy, drafter=drafter, gamma=4)
        assert ids == reference, drafter
        drafted += stats.drafted
    assert drafted > 0


def test_a_seed_gives_the_same_tokens_for_every_drafter_and_gamma(engine):
    params = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, max_new_tokens=32, seed=2024)
    plain, stats = generate_ids(engine, EDIT, sampling=params, drafter="none")
    assert stats.seed == 2024
    accepted = rejected = 0
    for drafter in DRAFTERS:
        for gamma in (1, 4, 16, "auto"):
            ids, stats = generate_ids(engine, EDIT, sampling=params, drafter=drafter, gamma=gamma)
            assert ids == plain, (drafter, gamma)
            accepted += stats.accepted
            rejected += stats.drafted - stats.accepted
    assert accepted > 0 and rejected > 0


class RandomDrafter(StatelessHooks):
    """Proposes tokens drawn uniformly from a candidate set (what it proposes never changes the output)."""

    name = "prompt-lookup"

    def __init__(self, candidates: list[int], seed: int = 0):
        self.candidates = candidates
        self.rng = random.Random(seed)

    def propose(self, context, max_tokens):
        return Draft(token_ids=[self.rng.choice(self.candidates) for _ in range(max_tokens)])


TEMPERATURE, TOP_K, PENALTY = 0.7, 2, 1.3


def test_two_verified_positions_follow_the_target_on_the_real_model(engine, hf_model):
    """Tokens 1-3 each have at most two choices (top-k 2), so (t2, t3) has at most 4 cells whose exact
    probabilities come from 7 transformers forwards. 300 samples, chi-square at p > 0.001."""
    messages = [{"role": "user", "content": "Say something."}]
    prompt = prompt_ids(engine, messages)

    def top2(prefix: list[int]) -> dict[int, float]:  # p'(. | prefix) by transformers' forward and processors
        ids = torch.tensor([prefix])
        with torch.inference_mode():
            scores = hf_model(ids).logits[:, -1, : engine.vocab_limit].float()
        scores = RepetitionPenaltyLogitsProcessor(PENALTY)(ids, scores)
        scores = TopKLogitsWarper(TOP_K)(ids, TemperatureLogitsWarper(TEMPERATURE)(ids, scores))
        probs = torch.softmax(scores, -1)[0]
        return {int(i): float(probs[i]) for i in torch.nonzero(probs > 0).flatten()}

    exact: dict[tuple[int, int], float] = {}
    for t1, p1 in top2(prompt).items():
        for t2, p2 in top2(prompt + [t1]).items():
            for t3, p3 in top2(prompt + [t1, t2]).items():
                exact[(t2, t3)] = exact.get((t2, t3), 0.0) + p1 * p2 * p3
    candidates = sorted({t for key in exact for t in key})
    junk = next(t for t in range(100, 200) if t not in candidates)  # never the target's token: always rejected
    original = engine.drafters["prompt-lookup"]
    engine.drafters["prompt-lookup"] = RandomDrafter(candidates + [junk])
    counts: dict[tuple[int, int], int] = {}
    samples = 300
    drafted = accepted = 0
    try:
        for s in range(samples):
            sampling = SamplingParams(
                temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0, repetition_penalty=PENALTY, max_new_tokens=4, seed=s
            )
            ids, stats = generate_ids(
                engine, messages, drafter="prompt-lookup", gamma=2, conversation="chi2", sampling=sampling
            )
            counts[(ids[1], ids[2])] = counts.get((ids[1], ids[2]), 0) + 1
            drafted += stats.drafted
            accepted += stats.accepted
    finally:
        engine.drafters["prompt-lookup"] = original
        engine.forget("chi2")
    assert drafted >= 2 * samples and 0 < accepted < drafted  # every sample verified 2-token drafts
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - samples * p) ** 2 / (samples * p) for k, p in exact.items())
    dof = len(exact) - 1
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(chi2 / 2.0, dtype=torch.float64)
        )
    )
    assert p_value > 1e-3, f"chi2={chi2:.1f} (dof {dof}); counts {counts}, exact {exact}"


def test_same_seed_same_sample(engine):
    params = dict(
        sampling=SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=7), drafter="prompt-lookup", gamma=3
    )
    a, _ = generate_ids(engine, CODE, **params)
    b, _ = generate_ids(engine, CODE, **params)
    assert a == b


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
    for drafter, gamma in [("prompt-lookup", 4), ("prompt-lookup", "auto"), ("suffix", 12), ("draft-model", 3)]:
        ids, stats = generate_ids(int4_engine, messages, sampling=greedy, drafter=drafter, gamma=gamma)
        assert ids == plain, (drafter, gamma)
        if drafter == "draft-model":  # the twin proposes what the target decides: verification took many at once
            assert stats.accepted > 0
    assert "Paris" in int4_engine.tokenizer.decode(plain) or messages is not CHAT
