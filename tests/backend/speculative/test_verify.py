"""verify.py: named greedy scenarios on forced-argmax logits; at temperature > 0 the emitted tokens are the
target's own Gumbel-max choices whatever was drafted (so they follow p, not q), for single tokens and for the
joint of two positions with a context-dependent target; coupled drafts (the draft picks with the target's
noise) are accepted at least (1 - TV)/(1 + TV) of the time.

Statistical tests state their sample counts; a chi-square p-value above 1e-3 is required against p, and the same
counts must reject q (p-value below 1e-12), which shows the test has the power to tell them apart.
"""

from __future__ import annotations

import pytest
import torch

from specchat.backend.api import TokenSource
from specchat.backend.speculative.sampling import GREEDY, SamplingRule, logits_to_probs, pick
from specchat.backend.speculative.verify import verify, verify_tokens

A, R, B, T = TokenSource.ACCEPTED, TokenSource.RECOVERED, TokenSource.BONUS, TokenSource.TARGET
VOCAB = 12
EOS = 11


def forced_logits(argmaxes: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[len, vocab] logits whose row i has its argmax at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(len(argmaxes)))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


# ---------------------------------------------------------------------------------------------------- greedy
def test_greedy_all_accepted_gives_bonus() -> None:
    result = verify(forced_logits([3, 4, 5, 6]), [3, 4, 5], GREEDY, range(4))
    assert result.tokens == [3, 4, 5, 6] and result.sources == [A, A, A, B] and result.accepted == 3


@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_greedy_rejection_at_each_position(reject_at: int) -> None:
    target = [1, 2, 3, 4, 5]
    draft = target[:4]
    draft[reject_at] = 9  # the draft disagrees here only
    result = verify(forced_logits(target), draft, GREEDY, range(5))
    assert result.accepted == reject_at
    assert result.tokens == target[: reject_at + 1]  # the recovered token is the target's argmax
    assert result.sources == [A] * reject_at + [R]


def test_empty_draft_is_a_plain_step() -> None:
    result = verify(forced_logits([7]), [], GREEDY, [0])
    assert result.tokens == [7] and result.sources == [T] and result.accepted == 0


def test_eos_inside_draft_is_just_a_token() -> None:
    result = verify(forced_logits([2, EOS, 4]), [2, EOS], GREEDY, range(3))
    assert result.tokens == [2, EOS, 4] and result.accepted == 2  # the engine, not verify, stops at EOS


def test_short_draft_out_of_vocab_draft_and_shape_errors() -> None:
    logits = forced_logits([2, 3, 4, 5, 6])  # rows for γ = 4, but only 2 drafted: extra rows ignored
    assert verify(logits, [2, 3], GREEDY, range(3)).tokens == [2, 3, 4]
    assert verify(logits, [VOCAB + 3], GREEDY, range(2)).tokens == [2]  # an id the target cannot emit: rejected
    with pytest.raises(ValueError, match="need \\[3, V\\] target logits and 3 positions"):
        verify(forced_logits([1, 2]), [1, 2], GREEDY, range(3))
    with pytest.raises(ValueError, match="and 3 positions"):
        verify(logits, [1, 2], GREEDY, range(5))
    with pytest.raises(ValueError, match="need 3 target tokens"):
        verify_tokens([1, 2], [1, 2])


# ------------------------------------------------------------------------------------------ sampled, exact
def test_sampled_output_is_the_targets_own_tokens_whatever_the_draft() -> None:
    """Row i decides reply position first_position + i; the draft only decides how many rows one call keeps."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 2
    rule = SamplingRule(temperature=0.8, top_p=0.95, seed=77)
    own = pick(logits, rule, range(20, 25))
    for draft in ([], own[:1], own[:4], [own[0], (own[1] + 1) % 40], [(own[0] + 1) % 40]):
        result = verify(logits, draft, rule, range(20, 21 + len(draft)))
        assert result.tokens == own[: result.accepted + 1]
        assert result.accepted == next((i for i, (d, t) in enumerate(zip(draft, own)) if d != t), len(draft))


# ------------------------------------------------------------------------------------ sampled, statistical
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with zero probability must have zero counts."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = n * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def test_joint_of_two_verified_positions_matches_target_not_draft() -> None:
    """γ = 2 with a context-dependent target p(a) p(b | a) (temperature 0.7, top-p 0.9) and a draft model q(a)
    q(b | a) that picks with the same noise (coupled): 20,000 replies (reply j at positions 2j, 2j + 1 of one
    seed: unrelated noise), the joint of the first two emitted tokens must be p(a) p(b | a). The picks are
    vectorised; each reply is then verified as the engine does, and after a rejection at position 0 the second
    token comes from the next step's row."""
    vocab, trials = 5, 20_000
    gen = torch.Generator().manual_seed(20)
    t0, t1 = torch.randn(vocab, generator=gen) * 1.5, torch.randn(vocab, vocab, generator=gen) * 1.5
    d0, d1 = torch.randn(vocab, generator=gen) * 1.5, torch.randn(vocab, vocab, generator=gen) * 1.5
    warp = dict(temperature=0.7, top_k=None, top_p=0.9)
    rule = SamplingRule(**warp, seed=5)
    first_pos, second_pos = range(0, 2 * trials, 2), range(1, 2 * trials, 2)
    x0 = pick(d0.expand(trials, -1), rule, first_pos)  # the draft model's tokens, with the target's noise
    x1 = pick(d1[x0], rule, second_pos)
    row0 = pick(t0.expand(trials, -1), rule, first_pos)  # the target's rows of the verification pass
    row1 = pick(t1[x0], rule, second_pos)
    next_step = pick(t1[torch.tensor(row0)], rule, second_pos)  # the plain step after a rejection at 0
    counts = torch.zeros(vocab * vocab)
    accepted_total = 0
    for j in range(trials):
        result = verify_tokens([row0[j], row1[j], -1], [x0[j], x1[j]])
        accepted_total += result.accepted
        first = result.tokens[0]
        second = result.tokens[1] if len(result.tokens) > 1 else next_step[j]
        counts[first * vocab + second] += 1
    p0, p1 = logits_to_probs(t0, **warp), logits_to_probs(t1, **warp)
    q0, q1 = logits_to_probs(d0, **warp), logits_to_probs(d1, **warp)
    assert chi2_pvalue(counts, (p0[:, None] * p1).flatten()) > 1e-3
    assert chi2_pvalue(counts, (q0[:, None] * q1).flatten()) < 1e-12
    assert 0 < accepted_total < 2 * trials


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coupled_acceptance_is_at_least_the_bound(seed: int) -> None:
    """P(draft's perturbed argmax == target's) over 30,000 positions vs (1 - TV)/(1 + TV) (Daliri et al.), with
    three standard errors of slack; an independent draft would reach only Σ p·q."""
    gen = torch.Generator().manual_seed(seed)
    p_logits, q_logits = torch.randn(1, 30, generator=gen) * 2, torch.randn(1, 30, generator=gen) * 2
    rule = SamplingRule(temperature=1.0, seed=seed)
    n = 30_000
    target = torch.tensor(pick(p_logits.expand(n, -1), rule, range(n)))
    draft = torch.tensor(pick(q_logits.expand(n, -1), rule, range(n)))
    rate = float((target == draft).double().mean())
    p, q = torch.softmax(p_logits[0], -1), torch.softmax(q_logits[0], -1)
    tv = 0.5 * float((p - q).abs().sum())
    bound = (1 - tv) / (1 + tv)
    assert rate >= bound - 3 * (bound * (1 - bound) / n) ** 0.5, (rate, bound, tv)
    assert rate > float((p * q).sum())  # better than an independent draft
