"""sampling.py: logits -> probs (checked against transformers' own warpers where no tie meets a cut; ties are
cut by id: test_ties.py), the per-position repetition penalty (checked against transformers' processor on every
prefix), the Gumbel-max choice (an exact sample of p', the same for a row whatever its batch), and settings at the
edge of their ranges (a temperature of 1e-38, a penalty of 1e-30) that must never give NaN."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specchat.backend.errors import ModelOutputError, RequestError
from specchat.backend.speculative.sampling import (
    GREEDY,
    SamplingRule,
    SeenIds,
    apply_repetition_penalty,
    logits_to_probs,
    pick,
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
    [
        (1.0, None, None),
        (0.7, None, None),
        (1.3, 5, None),
        (0.8, None, 0.9),
        (0.6, 20, 0.8),
        (1.0, 0, 1.0),
        (2.0, 3, 0.5),
    ],
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


def test_top_k_cuts_ties_by_id_and_top_p_keeps_at_least_one() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, temperature=1.0, top_k=2, top_p=None)
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]  # the tie at the 2nd value: lower id
    probs = logits_to_probs(logits, temperature=1.0, top_k=3, top_p=0.5)  # token 0 alone holds 0.58 >= 0.5
    assert (probs[0] > 0).tolist() == [True, False, False, False, False]
    torch.testing.assert_close(probs, _reference(logits, 1.0, 3, 0.5))
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


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with zero probability must have zero counts."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = counts.sum() * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, None, None), (1.3, 4, None), (0.8, None, 0.9), (0.6, 5, 0.8)]
)
def test_pick_is_an_exact_sample_of_p(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """One row decided at 40,000 reply positions (each its own noise): the counts follow logits_to_probs (p-value
    > 1e-3) and reject the same settings at another temperature (p-value < 1e-12): the test has the power."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 2
    rule = SamplingRule(temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    n = 40_000
    tokens = pick(logits.expand(n, -1), rule, range(n))
    counts = torch.bincount(torch.tensor(tokens), minlength=12)
    p = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)[0]
    assert chi2_pvalue(counts, p) > 1e-3, (counts, p)
    wrong = logits_to_probs(logits, temperature=temperature * 1.5, top_k=top_k, top_p=top_p)[0]
    assert chi2_pvalue(counts, wrong) < 1e-12


def test_pick_is_greedy_at_zero_and_keyed_by_position_not_by_batch() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)) * 3
    assert pick(logits, GREEDY, range(6)) == logits.argmax(-1).tolist()
    for rule in (
        SamplingRule(temperature=0.8, seed=5),
        SamplingRule(temperature=0.8, top_p=0.9, seed=5),
        SamplingRule(temperature=1.2, top_k=20, seed=5),
    ):
        together = pick(logits, rule, range(10, 16))
        alone = [pick(logits[i : i + 1], rule, [10 + i])[0] for i in range(6)]
        assert together == alone
        shifted = pick(logits, rule, range(11, 17))  # another position is other noise
        other_seed = pick(logits, SamplingRule(rule.temperature, rule.top_k, rule.top_p, None, 6), range(10, 16))
        assert together != shifted or together != other_seed
    with pytest.raises(ValueError, match="need \\[2, V\\] logits"):
        pick(logits, GREEDY, [0, 1])


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-12])
def test_a_tiny_temperature_is_the_argmax_never_nan(temperature: float) -> None:
    """Dividing logits by 1e-38 overflows float32 (the old softmax gave NaN and sampling fell back to the last
    id: text like `ectableectable...`). Now p' is one-hot on the argmax and pick returns it."""
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(6)) * 5
    for top_k, top_p in ((None, None), (50, None), (None, 0.9), (50, 0.9)):
        probs = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        assert torch.isfinite(probs).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.allclose(probs.max(-1).values, torch.ones(4))
        rule = SamplingRule(temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
        assert pick(logits, rule, range(4)) == logits.argmax(-1).tolist()


def test_a_tiny_repetition_penalty_stays_finite() -> None:
    """Penalty 1e-30 divides positive logits by 1e-30: finite (clamped to float32's range), and the choice among
    seen ids still follows the penalised logits."""
    logits = torch.tensor([[3.0, -2.0, 1e9, 0.5, 2.0]])
    out = apply_repetition_penalty(logits, [0, 1, 2], 1e-30)
    assert torch.isfinite(out).all()
    assert out[0, 2] == torch.finfo(torch.float32).max and out[0, 0] == pytest.approx(3e30)
    for rule in (GREEDY, SamplingRule(temperature=0.7, top_p=0.9, repetition_penalty=1e-30, seed=3)):
        assert pick(out, rule, [0]) == [2]
    assert torch.isfinite(logits_to_probs(out, temperature=0.7, top_k=None, top_p=0.9)).all()


def test_nan_logits_raise_instead_of_sampling() -> None:
    logits = torch.randn(2, 50)
    logits[1, 7] = float("nan")
    for rule in (GREEDY, SamplingRule(temperature=0.9, seed=0), SamplingRule(temperature=0.9, top_k=5, seed=0)):
        with pytest.raises(ModelOutputError, match="NaN logits"):
            pick(logits, rule, [0, 1])


def test_seen_ids_follow_a_growing_sequence_and_rebuild_when_it_changes() -> None:
    seen = SeenIds()
    seen.sync([5, 6, 5])
    assert seen.tensor().tolist() == [5, 6]
    seen.sync([5, 6, 5, 9, 6])  # grew
    assert seen.tensor().tolist() == [5, 6, 9]
    seen.add([11])
    assert 11 in seen and seen.tensor().tolist() == [5, 6, 9, 11]
    seen.sync([7, 8])  # another sequence: rebuilt
    assert seen.tensor().tolist() == [7, 8] and 5 not in seen


def test_a_pass_of_many_rows_picks_what_each_row_alone_picks():
    """pick draws the noise a few rows at a time (PICK_ROWS, to bound its memory): the tokens are those of each row
    picked on its own, and those of all rows at once, for every filter."""
    import torch

    from specchat.backend.speculative import sampling

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(19, 500, generator=generator) * 3
    positions = list(range(40, 59))
    for top_k, top_p in ((None, None), (50, None), (None, 0.9), (20, 0.8)):
        rule = sampling.SamplingRule(temperature=0.8, top_k=top_k, top_p=top_p, seed=11)
        alone = [sampling.pick(logits[i : i + 1], rule, [p])[0] for i, p in enumerate(positions)]
        assert sampling.pick(logits, rule, positions) == alone
        kept = sampling.ranked_candidates(logits, temperature=0.8, top_k=top_k, top_p=top_p)
        if kept is None:  # all rows at once, as before the rows were drawn in groups
            ids = torch.arange(500)[None]
            together = sampling._gumbel_max(logits, ids, None, rule, positions)
        else:
            together = sampling._gumbel_max(logits.gather(1, kept[0]), kept[0], kept[1], rule, positions)
        assert together == alone
