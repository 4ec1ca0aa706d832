"""sampling.py: logits -> probs (checked against transformers' own warpers), the
per-position repetition penalty (checked against transformers' processor on every prefix), seeded sampling."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specchat.backend.errors import RequestError
from specchat.backend.spec.sampling import (
    apply_repetition_penalty,
    logits_to_probs,
    make_generator,
    sample,
)


def test_temperature_zero_is_never_sampled() -> None:
    with pytest.raises(RequestError, match="temperature = 0 means greedy"):
        logits_to_probs(torch.zeros(1, 4), temperature=0.0, top_k=None, top_p=None)


def _reference(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.7, None, None), (1.3, 5, None), (0.8, None, 0.9), (0.6, 20, 0.8), (1.0, 0, 1.0),
     (2.0, 3, 0.5)],
)
def test_logits_to_probs_matches_transformers_warpers(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    probs = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    torch.testing.assert_close(probs, _reference(logits, temperature, top_k, top_p), atol=1e-6, rtol=1e-5)
    if top_k:
        assert int((probs > 0).sum(-1).max()) <= top_k


def test_top_p_on_a_flat_distribution_uses_the_full_sort() -> None:
    # 2,000 nearly equal logits: the nucleus is far wider than the first 256 candidates
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(5)) * 0.1
    probs = logits_to_probs(logits, temperature=1.0, top_k=None, top_p=0.9)
    assert int((probs > 0).sum(-1).min()) > 1000
    torch.testing.assert_close(probs, _reference(logits, 1.0, None, 0.9), atol=1e-7, rtol=1e-5)


def test_top_p_with_a_nucleus_of_hundreds() -> None:
    # ~1,000 plausible tokens out of 6,000: found at the second candidate stage (4096), without a full sort
    logits = torch.randn(2, 6000, generator=torch.Generator().manual_seed(6)) * 0.1 - 12.0
    logits[:, :1000] += 12.0
    probs = logits_to_probs(logits, temperature=1.0, top_k=None, top_p=0.9)
    assert 256 < int((probs > 0).sum(-1).max()) < 1000
    torch.testing.assert_close(probs, _reference(logits, 1.0, None, 0.9), atol=1e-7, rtol=1e-5)


def test_top_k_keeps_ties_and_top_p_keeps_at_least_one() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, temperature=1.0, top_k=2, top_p=None)
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]  # both ties at the 2nd value stay
    probs = logits_to_probs(logits, temperature=1.0, top_k=2, top_p=0.5)  # token 0 alone holds 0.58 >= 0.5
    assert (probs[0] > 0).tolist() == [True, False, False, False, False]
    torch.testing.assert_close(probs, _reference(logits, 1.0, 2, 0.5))
    one = logits_to_probs(logits, temperature=1.0, top_k=None, top_p=1e-6)
    assert one[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    vec = logits_to_probs(logits[0], temperature=0.5, top_k=None, top_p=None)  # [V] in, [V] out
    assert vec.shape == (5,)


def test_repetition_penalty_matches_transformers_row_by_row() -> None:
    g = torch.Generator().manual_seed(1)
    vocab, penalty = 50, 1.3
    context = torch.randint(0, vocab, (30,), generator=g).tolist()
    drafts = [7, 7, 41, 3]  # a repeated draft id and ids maybe absent from the context
    logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 4
    out = apply_repetition_penalty(logits, context, penalty, drafts)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i in range(len(drafts) + 1):
        ids = torch.tensor([context + drafts[:i]])
        expected = processor(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(out[i], expected)
    # position i really sees draft i-1: id 41 is penalised from row 3 on, not before (unless in the context)
    if 41 not in context:
        assert out[2, 41] == logits[2, 41] and out[3, 41] != logits[3, 41]


def test_repetition_penalty_edge_cases() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 1.0]])
    assert apply_repetition_penalty(logits, [0, 1], None) is logits
    assert apply_repetition_penalty(logits, [0, 1], 1.0) is logits
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 99, -5]), 2.0)  # out-of-range ids are ignored
    assert out.tolist() == [[1.0, -4.0, 0.0, 1.0]]
    assert apply_repetition_penalty(logits[0], [3], 2.0).tolist() == [2.0, -2.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="need 1 draft ids"):
        apply_repetition_penalty(torch.zeros(2, 4), [0], 1.2, [])


def test_generator_is_seeded_per_request() -> None:
    probs = torch.softmax(torch.randn(8, 40, generator=torch.Generator().manual_seed(2)), dim=-1)
    a = sample(probs, make_generator(123, "cpu"))
    b = sample(probs, make_generator(123, "cpu"))
    assert a.shape == (8,) and a.dtype == torch.long and torch.equal(a, b)
    g = make_generator(None, torch.device("cpu"))
    h = make_generator(None, torch.device("cpu"))
    assert g.initial_seed() != h.initial_seed()
    assert sample(probs[0], g).dim() == 0


def test_sample_follows_probs() -> None:
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])  # zero mass at both ends and inside
    draws = sample(probs.expand(40_000, 6) * 7.0, make_generator(0, "cpu"))  # unnormalised rows are fine
    freq = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert freq[0] == 0 and freq[2] == 0 and freq[5] == 0
    assert (freq - probs).abs().max() < 0.01
    point = torch.zeros(3, 6)
    point[torch.arange(3), torch.tensor([0, 5, 2])] = 1.0
    assert sample(point, make_generator(1, "cpu")).tolist() == [0, 5, 2]
