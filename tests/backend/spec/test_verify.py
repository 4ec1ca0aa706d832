"""verify.py: greedy verification on forced-argmax logits (named scenarios), rejection sampling's exact cases,
and statistical losslessness: the emitted tokens follow p (the target), not q (the draft).

Statistical tests are seeded and vectorised through rejection_sample (many independent trials in one call);
each states its sample count. A chi-square p-value above 1e-3 is required against p, and the same counts must
reject q (p-value below 1e-12), which shows the test has the power to tell them apart.
"""

from __future__ import annotations

import pytest
import torch

from specchat.backend.api import TokenSource
from specchat.backend.spec.sampling import logits_to_probs, make_generator
from specchat.backend.spec.verify import rejection_sample, verify_greedy, verify_sampling

A, R, B = TokenSource.ACCEPTED, TokenSource.RECOVERED, TokenSource.BONUS
VOCAB = 12
EOS = 11


def forced_logits(argmaxes: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[len, vocab] logits whose row i has its argmax at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(len(argmaxes)))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


# ---------------------------------------------------------------------------------------------------- greedy
def test_greedy_all_accepted_gives_bonus() -> None:
    result = verify_greedy(forced_logits([3, 4, 5, 6]), [3, 4, 5])
    assert result.tokens == [3, 4, 5, 6] and result.sources == [A, A, A, B] and result.accepted == 3


@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_greedy_rejection_at_each_position(reject_at: int) -> None:
    target = [1, 2, 3, 4, 5]
    draft = target[:4]
    draft[reject_at] = 9  # the draft disagrees here only
    result = verify_greedy(forced_logits(target), draft)
    assert result.accepted == reject_at
    assert result.tokens == target[: reject_at + 1]  # the recovered token is the target's argmax
    assert result.sources == [A] * reject_at + [R]


def test_greedy_empty_draft_is_a_plain_step() -> None:
    result = verify_greedy(forced_logits([7]), [])
    assert result.tokens == [7] and result.sources == [B] and result.accepted == 0


def test_greedy_eos_inside_draft_is_just_a_token() -> None:
    result = verify_greedy(forced_logits([2, EOS, 4]), [2, EOS])
    assert result.tokens == [2, EOS, 4] and result.accepted == 2  # the engine, not verify, stops at EOS


def test_greedy_short_draft_and_padded_vocab() -> None:
    logits = forced_logits([2, 3, 4, 5, 6])  # rows for γ = 4, but only 2 drafted: extra rows ignored
    assert verify_greedy(logits, [2, 3]).tokens == [2, 3, 4]
    padded = torch.cat([forced_logits([2, 3]), torch.full((2, 4), 50.0)], dim=-1)  # padded columns win argmax
    assert verify_greedy(padded, [2], vocab_size=VOCAB).tokens == [2, 3]
    with pytest.raises(ValueError, match="need \\[3, V\\]"):
        verify_greedy(forced_logits([1, 2]), [1, 2])


# ------------------------------------------------------------------------------------------ sampling, exact
def one_hot(ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_sampling_certain_cases() -> None:
    g = make_generator(0, "cpu")
    # p puts all mass on the drafts: always accepted, then the bonus from the last row
    result = verify_sampling(one_hot([3, 4, 5]), [3, 4], one_hot([3, 4]) * 0.5 + 0.5 / VOCAB, g)
    assert result.tokens == [3, 4, 5] and result.sources == [A, A, B]
    # p gives the first draft probability 0: rejected, and the recovered token is never the draft
    for _ in range(20):
        result = verify_sampling(one_hot([6, 1]), [3], one_hot([3]), g)
        assert result.tokens == [6] and result.sources == [R] and result.accepted == 0
    # one-hot q (prompt lookup): p(x) = 0 is always rejected, p(x) = 1 always accepted
    assert verify_sampling(one_hot([6, 1]), [3], None, g).tokens == [6]
    assert verify_sampling(one_hot([3, 1]), [3], None, g).tokens == [3, 1]
    # empty draft: one bonus token from p_0
    assert verify_sampling(one_hot([8]), [], None, g).tokens == [8]


def test_sampling_residual_zero_falls_back_to_p() -> None:
    # p == q exactly: a rejection is (numerically) impossible; force one via a draft id with p = q = 0 there
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4])
    result = verify_sampling(p, [2], p[:1].clone(), make_generator(1, "cpu"))
    assert result.accepted == 0 and result.tokens[0] in (0, 1)  # sampled from p, not an all-zero residual


def test_sampling_out_of_vocab_draft_is_rejected() -> None:
    p = torch.softmax(torch.randn(2, 6), -1)
    q = torch.zeros(1, 9)
    q[0, 7] = 1.0  # the draft's wider vocabulary put all its mass on id 7 >= the target's 6
    for seed in range(10):
        result = verify_sampling(p, [7], q, make_generator(seed, "cpu"))
        assert result.accepted == 0 and result.tokens[0] < 6


def test_same_seed_same_result() -> None:
    p = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)), -1)
    q = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)), -1)
    runs = [
        [verify_sampling(p, [1, 2, 3], q, g).tokens for _ in range(30)]
        for g in (make_generator(5, "cpu"), make_generator(5, "cpu"))
    ]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------ sampling, statistical
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


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - probs.double()).abs().sum())


def random_dist(*shape: int, seed: int, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * sharp, -1)


def first_tokens(
    p0: torch.Tensor, draft_probs: torch.Tensor | None, draft_ids: torch.Tensor, seed: int
) -> torch.Tensor:
    """Run len(draft_ids) independent verifications whose target rows are all p0 (a context-free target) and
    return the first emitted token of each."""
    trials, k = draft_ids.shape
    target = p0.expand(trials, k + 1, -1)
    accepted, next_token = rejection_sample(target, draft_ids, draft_probs, make_generator(seed, "cpu"))
    return torch.where(accepted > 0, draft_ids[:, 0], next_token)


@pytest.mark.parametrize(("vocab", "seed"), [(5, 0), (8, 1)])
def test_converges_to_p_not_q(vocab: int, seed: int) -> None:
    p, q = random_dist(vocab, seed=seed), random_dist(vocab, seed=seed + 100)
    assert 0.5 * float((p - q).abs().sum()) > 0.15  # the two really differ
    errors = []
    for trials in (1_000, 10_000, 100_000):  # stated sample counts, growing
        g = make_generator(seed, "cpu")
        drafts = torch.multinomial(q.expand(trials, vocab), 3, replacement=True, generator=g)  # γ = 3, x_i ~ q
        counts = torch.bincount(first_tokens(p, q.expand(trials, 3, vocab), drafts, seed), minlength=vocab)
        errors.append(tv(counts, p))
    assert errors[-1] < 0.008 and errors[-1] < errors[0]  # TV(empirical, p) shrinks like 1/sqrt(N)
    assert tv(counts, q) > 0.1  # ... and does not approach q
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(counts, q) < 1e-12


@pytest.mark.parametrize("how", ["fixed-likely", "fixed-unlikely", "fixed-impossible", "uniform"])
def test_one_hot_draft_is_lossless(how: str) -> None:
    vocab, trials = 6, 100_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 2
    p = logits_to_probs(logits, temperature=1.0, top_k=4, top_p=None)
    order = p.argsort(descending=True).tolist()
    if how == "uniform":  # the deterministic draft may be any function of the context: here a random one
        drafts = torch.randint(0, vocab, (trials, 2), generator=torch.Generator().manual_seed(8))
    else:
        x = {"fixed-likely": order[0], "fixed-unlikely": order[3], "fixed-impossible": order[-1]}[how]
        drafts = torch.full((trials, 2), x)
    counts = torch.bincount(first_tokens(p, None, drafts, seed=9), minlength=vocab)
    assert chi2_pvalue(counts, p) > 1e-3, (counts, p)


@pytest.mark.parametrize(("top_k", "top_p"), [(4, None), (None, 0.8), (5, 0.7)])
def test_lossless_with_top_k_top_p_on_both(top_k: int | None, top_p: float | None) -> None:
    vocab, trials = 8, 100_000
    gen = torch.Generator().manual_seed(10)
    target_logits, draft_logits = torch.randn(vocab, generator=gen), torch.randn(vocab, generator=gen)
    p = logits_to_probs(target_logits, temperature=1.2, top_k=top_k, top_p=top_p)
    q = logits_to_probs(draft_logits, temperature=1.2, top_k=top_k, top_p=top_p)
    assert (p > 0).sum() >= 3 and (p == 0).sum() >= 2  # a real, filtered distribution
    drafts = torch.multinomial(q.expand(trials, vocab), 2, replacement=True, generator=make_generator(11, "cpu"))
    counts = torch.bincount(first_tokens(p, q.expand(trials, 2, vocab), drafts, seed=12), minlength=vocab)
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(counts, q) < 1e-12


def test_padded_vocabularies_are_lossless() -> None:
    """Target with 3 padded output columns (some mass there, renormalised away); draft with a wider vocabulary
    that puts mass on ids the target lacks (those drafts must be rejected, q not renormalised)."""
    vocab, trials = 6, 100_000
    p_padded = random_dist(vocab + 3, seed=13)
    p = p_padded[:vocab] / p_padded[:vocab].sum()
    q = random_dist(vocab + 5, seed=14, sharp=1.0)
    drafts = torch.multinomial(q.expand(trials, vocab + 5), 2, replacement=True, generator=make_generator(15, "cpu"))
    target = p_padded.expand(trials, 3, vocab + 3)
    accepted, next_token = rejection_sample(
        target, drafts, q.expand(trials, 2, vocab + 5), make_generator(16, "cpu"), vocab_size=vocab
    )
    first = torch.where(accepted > 0, drafts[:, 0], next_token)
    assert int(first.max()) < vocab
    assert chi2_pvalue(torch.bincount(first, minlength=vocab), p) > 1e-3


def test_joint_of_first_two_tokens_matches_target() -> None:
    """γ = 2 with a context-dependent target p(a) p(b | a) and draft q(a) q(b | a): the joint of the first two
    emitted tokens must be p(a) p(b | a). After a rejection at position 0 the second token comes from the next
    (plain) step, p(. | recovered)."""
    vocab, trials = 5, 200_000
    p0, p1 = random_dist(vocab, seed=20), random_dist(vocab, vocab, seed=21)
    p2 = random_dist(vocab, vocab, vocab, seed=22)
    q0, q1 = random_dist(vocab, seed=23), random_dist(vocab, vocab, seed=24)
    g = make_generator(25, "cpu")
    x0 = torch.multinomial(q0.expand(trials, vocab), 1, generator=g).squeeze(-1)
    x1 = torch.multinomial(q1[x0], 1, generator=g).squeeze(-1)
    target = torch.stack([p0.expand(trials, vocab), p1[x0], p2[x0, x1]], dim=1)  # [trials, 3, V]
    draft_probs = torch.stack([q0.expand(trials, vocab), q1[x0]], dim=1)  # [trials, 2, V]
    accepted, tok = rejection_sample(target, torch.stack([x0, x1], 1), draft_probs, g)
    plain_next = torch.multinomial(p1[tok], 1, generator=g).squeeze(-1)  # the next step after a rejection at 0
    first = torch.where(accepted == 0, tok, x0)
    second = torch.where(accepted == 0, plain_next, torch.where(accepted == 1, tok, x1))
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab)
    joint_p = (p0[:, None] * p1).flatten()
    joint_q = (q0[:, None] * q1).flatten()
    assert chi2_pvalue(counts, joint_p) > 1e-3
    assert chi2_pvalue(counts, joint_q) < 1e-12


def test_single_call_verify_sampling_is_lossless() -> None:
    """The engine's per-step entry point (not the batched core), 3,000 calls on a 4-token vocabulary."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    q = torch.tensor([0.4, 0.1, 0.4, 0.1])
    g = make_generator(30, "cpu")
    drafts = torch.multinomial(q, 3_000, replacement=True, generator=g).tolist()
    firsts = [verify_sampling(p.expand(2, 4), [x], q[None], g).tokens[0] for x in drafts]
    counts = torch.bincount(torch.tensor(firsts), minlength=4)
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(counts, q) < 1e-12


def test_single_call_path_equals_batched_core() -> None:
    """verify_sampling (the engine's path) draws the same random numbers as rejection_sample with B = 1, so on
    the same seed both emit the same tokens: the statistical tests on the batched core cover it too."""
    gen = torch.Generator().manual_seed(40)
    for case in range(200):
        k = case % 5
        v_t, v_d = (10, 10) if case % 3 else (13, 11)  # some cases with padded, unequal widths
        p = random_dist(k + 1, v_t, seed=1000 + case, sharp=1.0)
        q = None if case % 4 == 0 else random_dist(k, v_d, seed=2000 + case, sharp=1.0)
        high = v_d if q is not None else v_t
        draft = torch.randint(0, high, (k,), generator=gen).tolist()
        one = verify_sampling(p, draft, q, make_generator(case, "cpu"), vocab_size=10)
        accepted, token = rejection_sample(
            p[None], torch.tensor([draft], dtype=torch.long).reshape(1, k), None if q is None else q[None],
            make_generator(case, "cpu"), vocab_size=10,
        )
        assert (one.accepted, one.tokens[-1]) == (int(accepted), int(token)), case
        assert one.tokens[:-1] == draft[: one.accepted] and one.tokens[-1] < 10
