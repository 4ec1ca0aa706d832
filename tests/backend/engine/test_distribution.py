"""Sampled replies follow the target's exact distribution, through the real engine path (issue 14).

The target is a tiny Llama; the draft model is the same model with perturbed weights (its own distribution q,
close enough to p that most drafts are accepted, so both verified positions are usually decided in one pass).
Settings: temperature 0.7, top-k 3, top-p 0.95, repetition penalty 1.3, γ 2, three new tokens. The joint of the
2nd and 3rd tokens (the first two positions verification decides) is counted over 800 seeds and compared by
chi-square with the exact probabilities computed with transformers' own processors on transformers' own
forward. The same test must fail for two deliberately wrong engines: the penalty context shifted by one token
(the old bug's kind), and the noise keyed by the step instead of the reply position (rows of one pass share
noise). Every variant emits the same reply for a seed whatever the drafter, so the counts depend only on the
target path. The draft model's own proposals (a draft farther from the target) are checked against q the same
way, and shown not to follow p.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import tiny_loaded, tiny_pair
from tiny_models import build_tiny, one_thread, random_ids  # noqa: F401  (one_thread: autouse)
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.engine.request import RequestState
from specchat.backend.engine.target_pass import TargetPasses
from specchat.backend.speculative.sampling import SamplingRule

TEMPERATURE, TOP_K, TOP_P, PENALTY = 0.7, 3, 0.95, 1.3
SAMPLES = 800
PROMPT = random_ids(6, seed=5)
EOS = 2


def perturbed_twin(std: float):
    """The target's weights plus Gaussian noise: a draft model with its own distribution, close to p."""
    draft = tiny_loaded("llama")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in draft.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * std)
    return draft


def processed(model, context: list[int], shift: bool = False) -> dict[int, float]:
    """p'(. | context) by transformers' own forward and processors (``shift``: penalty context minus its last
    token)."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[:, -1, :].float()
    ids = torch.tensor([context[:-1] if shift else context])
    scores = RepetitionPenaltyLogitsProcessor(PENALTY)(ids, logits)
    for warper in (TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K), TopPLogitsWarper(TOP_P)):
        scores = warper(ids, scores)
    probs = torch.softmax(scores, -1)[0]
    return {int(i): float(probs[i]) for i in torch.nonzero(probs > 0).flatten()}


def exact_joint(model, prompt: list[int], skip_first: bool) -> dict[tuple[int, ...], float]:
    """P(tokens 2 and 3) (token 1 summed out); a reply that ends with EOS earlier is its own cell."""
    joint: dict[tuple[int, ...], float] = {}
    firsts = processed(model, prompt) if not skip_first else {}
    for t0, p0 in firsts.items():
        if t0 == EOS:
            joint[(EOS,)] = joint.get((EOS,), 0.0) + p0
            continue
        for t1, p1 in processed(model, prompt + [t0]).items():
            if t1 == EOS:
                joint[(EOS, EOS)] = joint.get((EOS, EOS), 0.0) + p0 * p1
                continue
            for t2, p2 in processed(model, prompt + [t0, t1]).items():
                joint[(t1, t2)] = joint.get((t1, t2), 0.0) + p0 * p1 * p2
    return joint


def chi2_pvalue(counts: dict, exact: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson chi-square; cells expected below 5 times are pooled; a count outside the support gives 0."""
    if any(key not in exact for key in counts):
        return 0.0
    big = {key: p for key, p in exact.items() if p * n >= 5}
    pooled = 1.0 - sum(big.values())
    stat = sum((counts.get(key, 0) - n * p) ** 2 / (n * p) for key, p in big.items())
    cells = len(big)
    if pooled * n > 1e-9:
        rest = n - sum(counts.get(key, 0) for key in big)
        stat += (rest - n * pooled) ** 2 / (n * pooled)
        cells += 1
    dof = cells - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


def shifted_penalty_context(self: TargetPasses) -> torch.Tensor:
    """Wrong on purpose: the penalty context lags one token behind (the pending token is left out)."""
    return torch.tensor(self.seen._seq[:-1], dtype=torch.long)


def step_keyed_positions(self: RequestState, rows: int) -> list[int]:
    """Wrong on purpose: every row of a pass gets the pass's number as its noise key (prefill 0, steps 1, 2..)."""
    return [self.stats.counts.total_steps + (1 if self.produced else 0)] * rows


@pytest.fixture(scope="module")
def exact() -> dict[tuple[int, ...], float]:
    return exact_joint(build_tiny("llama"), PROMPT, skip_first=False)


@pytest.mark.parametrize("variant", ["right", "penalty shifted by one token", "noise keyed by step"])
def test_two_verified_positions_follow_the_target(variant, exact, monkeypatch):
    if variant == "penalty shifted by one token":
        monkeypatch.setattr(TargetPasses, "penalty_context", shifted_penalty_context)
    elif variant == "noise keyed by step":
        monkeypatch.setattr(RequestState, "_positions", step_keyed_positions)
    engine = Engine(tiny_loaded("llama"), perturbed_twin(0.005), tiny_pair(drafter="draft-model", gamma=2))
    counts: dict[tuple[int, ...], int] = {}
    one_pass = 0
    for seed in range(SAMPLES):
        sampling = SamplingParams(
            temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, repetition_penalty=PENALTY, max_new_tokens=3, seed=seed
        )
        events = list(engine.generate(GenerationRequest(prompt_ids=PROMPT, sampling=sampling, conversation="c")))
        ids = [t for e in events for t in e.token_ids]
        key = (EOS,) if ids[0] == EOS else (EOS, EOS) if ids[1] == EOS else (ids[1], ids[2])
        counts[key] = counts.get(key, 0) + 1
        one_pass += events[1].accepted == 1  # positions 2 and 3 decided by one verification pass (γ capped at 1)
    assert one_pass > SAMPLES * 3 // 4
    p_value = chi2_pvalue(counts, exact, SAMPLES)
    if variant == "right":
        assert p_value > 1e-3, (p_value, counts)
    else:
        assert p_value < 1e-6, (variant, p_value, counts)


def test_the_draft_models_own_drafts_follow_q():
    """The draft model's two drafted tokens, proposed at reply positions 1 and 2 of 800 seeds, follow
    q'(x1) q'(x2 | x1) with the penalty (context plus the drafts before), temperature, top-k and top-p; a draft
    this far from the target does not follow p' (its proposals are its own, not the target's)."""
    engine = Engine(tiny_loaded("llama"), perturbed_twin(0.1), tiny_pair(drafter="draft-model", gamma=2))
    drafter = engine.drafters["draft-model"]
    context = PROMPT + [PROMPT[0]]  # the prompt and a first reply token: drafts start at reply position 1
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SAMPLES):
        drafter.configure(SamplingRule(TEMPERATURE, TOP_K, TOP_P, PENALTY, seed), len(PROMPT))
        tokens = drafter.propose(context, 2).token_ids
        key = tuple(tokens) if tokens[0] != EOS else (EOS, EOS)
        counts[key] = counts.get(key, 0) + 1

    def two_drafts(model) -> dict[tuple[int, ...], float]:  # the engine switched the draft's attention: a fresh copy
        joint: dict[tuple[int, ...], float] = {}
        for x1, q1 in processed(model, context).items():
            if x1 == EOS:
                joint[(EOS, EOS)] = q1
                continue
            for x2, q2 in processed(model, context + [x1]).items():
                joint[(x1, x2)] = q1 * q2
        return joint

    assert chi2_pvalue(counts, two_drafts(perturbed_twin(0.1).model), SAMPLES) > 1e-3, counts
    assert chi2_pvalue(counts, two_drafts(build_tiny("llama")), SAMPLES) < 1e-6, counts


_RIGHT_TREE_DECIDER = TargetPasses.tree_decider


def depth_blind_tree_decider(self: TargetPasses, logits: torch.Tensor, first: int):
    """Wrong on purpose: every node of a tree is decided with the noise of the step's first reply position."""

    def decide(row: int, path: list[int]) -> int:
        return _RIGHT_TREE_DECIDER(self, logits, first - len(path))(row, path)  # the right one keys by first + depth

    return decide


@pytest.mark.parametrize("variant", ["right", "noise blind to the depth"])
def test_tree_drafts_of_a_head_follow_the_target(variant, exact, monkeypatch):
    """The same joint, drafted by an EAGLE-3 head's dynamic trees (up to 3 nodes in the first step: branches at
    depth 1 when the head is unsure): the target's Gumbel coupling picks the child to follow, so the reply keeps
    p exactly; the wrong engine still fails."""
    from tiny_heads import TAPS, trained_eagle3

    from specchat.backend.models.loading.head_loading import LoadedHead

    if variant == "noise blind to the depth":
        monkeypatch.setattr(TargetPasses, "tree_decider", depth_blind_tree_decider)
    engine = Engine(tiny_loaded("llama"), None, tiny_pair(drafter="eagle3", gamma=4))
    head = trained_eagle3(prompt=tuple(PROMPT), steps=150)  # it knows what the target says after PROMPT
    engine.attach_head(LoadedHead("eagle3", head, TAPS, "tiny"))
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(SAMPLES):
        sampling = SamplingParams(
            temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, repetition_penalty=PENALTY, max_new_tokens=5, seed=seed
        )  # 5 tokens: the first step's tree may have 3 nodes (γ is capped by the tokens left)
        events = list(engine.generate(GenerationRequest(prompt_ids=PROMPT, sampling=sampling, conversation="c")))
        ids = [t for e in events for t in e.token_ids]
        key = (EOS,) if ids[0] == EOS else (EOS, EOS) if ids[1] == EOS else (ids[1], ids[2])
        counts[key] = counts.get(key, 0) + 1
        accepted += len(events) > 1 and events[1].accepted >= 1  # tokens 2 and 3 decided by one tree pass
    assert accepted > SAMPLES // 4  # trees were accepted often: verification decided those positions
    p_value = chi2_pvalue(counts, exact, SAMPLES)
    if variant == "right":
        assert p_value > 1e-3, (p_value, counts)
    else:  # only tree steps that went past depth 1 are wrong here: fewer wrong samples than the tests above
        assert p_value < 1e-4, (variant, p_value, counts)
