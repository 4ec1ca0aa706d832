"""Ties and pass shapes (issue 32): a sampled token is a function of (its row of logits, the seed, its position)
only. bfloat16-derived logits tie exactly and often; every cut through tied logits is decided by token id, and
the same row gives the same token alone or among any other rows, whatever the vectorised arithmetic rounds.
Settings that reduce to one token (a temperature below GREEDY_TEMPERATURE, top-k 1, a tiny top-p) are greedy
exactly: the argmax, the lowest id among ties."""

from __future__ import annotations

import pytest
import torch

from specchat.backend.limits import GREEDY_TEMPERATURE
from specchat.backend.speculative import candidates, sampling
from specchat.backend.speculative.candidates import ranked_candidates, top_k_ids
from specchat.backend.speculative.sampling import GREEDY, SamplingRule, logits_to_probs, pick


def tied_rows(n: int, vocab: int, seed: int, *, spread: float = 2.0) -> torch.Tensor:
    """[n, vocab] float32 logits rounded to bfloat16 (as a bf16 model's are): many exact ties near the top."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * spread).to(torch.bfloat16).float()


def kept_sets(logits: torch.Tensor, **settings) -> list[list[int]]:
    kept = ranked_candidates(logits, **settings)
    assert kept is not None
    ids, keep = kept
    return [ids[i][keep[i]].tolist() for i in range(ids.shape[0])]


def test_top_k_takes_the_lowest_ids_among_the_tied_and_ranks_by_logit_then_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    assert top_k_ids(logits, 1).tolist() == [[1]]
    assert top_k_ids(logits, 3).tolist() == [[1, 3, 2]]  # 2.0 is tied three ways: id 2 goes first
    assert top_k_ids(logits, 4).tolist() == [[1, 3, 2, 4]]
    probs = logits_to_probs(logits, temperature=1.0, top_k=3, top_p=None)[0]
    assert (probs > 0).nonzero()[:, 0].tolist() == [1, 2, 3]
    assert probs[1] == probs[3] and probs[2] < probs[1]


def test_top_p_cuts_through_a_tie_by_id() -> None:
    # Four ids tied: each holds 0.25 of the mass; top-p 0.5 keeps the two lowest ids (0.25 before the second).
    logits = torch.tensor([[-100.0, 5.0, 5.0, -300.0, 5.0, 5.0]])
    assert kept_sets(logits, temperature=1.0, top_k=None, top_p=0.5) == [[1, 2]]
    assert kept_sets(logits, temperature=1.0, top_k=None, top_p=0.5000001) == [[1, 2, 4]]
    assert kept_sets(logits, temperature=1.0, top_k=3, top_p=0.9) == [[1, 2, 4]]


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0, top_k=None, top_p=0.9),
        dict(temperature=1.0, top_k=None, top_p=0.5),
        dict(temperature=0.7, top_k=40, top_p=0.9),
        dict(temperature=1.3, top_k=7, top_p=None),
        dict(temperature=0.01, top_k=None, top_p=0.95),
        dict(temperature=1.0, top_k=None, top_p=None),
    ],
)
def test_a_row_gets_the_same_token_alone_and_in_any_pass(settings) -> None:
    """Rows with many exact ties, decided alone and in passes of 3, 17 and 64 rows, beside a flat row whose
    nucleus is thousands wide (so the pass looks at more candidates than the row needs): the same tokens."""
    vocab = 6000
    rows = tied_rows(64, vocab, seed=1)
    flat = tied_rows(1, vocab, seed=2, spread=0.05)
    rule = SamplingRule(seed=123, **settings)
    alone = [pick(rows[i : i + 1], rule, [100 + i])[0] for i in range(64)]
    for size in (3, 17, 64):
        for start in range(0, 64, size):
            block = rows[start : start + size]
            got = pick(torch.cat([block, flat]), rule, [*range(100 + start, 100 + start + block.shape[0]), 999])
            assert got[:-1] == alone[start : start + block.shape[0]], (size, start)


@pytest.mark.parametrize(("top_k", "top_p"), [(None, 0.9), (None, 0.5), (40, 0.9), (25, None)])
def test_a_row_keeps_the_same_ids_alone_and_in_any_pass(top_k, top_p) -> None:
    """The kept set itself, not only the token drawn from it: on the old code (transformers' tie rule, candidates
    chosen per pass) 43 of these 64 rows kept other ids beside the flat row at top-p 0.9, 20 at top-k 40."""
    rows, flat = tied_rows(64, 6000, seed=1), tied_rows(1, 6000, seed=2, spread=0.05)
    settings = dict(temperature=1.0, top_k=top_k, top_p=top_p)
    alone = [kept_sets(rows[i : i + 1], **settings)[0] for i in range(64)]
    assert kept_sets(torch.cat([rows, flat]), **settings)[:-1] == alone
    assert kept_sets(rows[:17], **settings) == alone[:17]


@pytest.mark.parametrize(("top_k", "top_p"), [(None, 0.9), (None, 0.5), (50, 0.8), (None, 0.999)])
def test_the_vectorised_cut_is_the_definition(monkeypatch, top_k, top_p) -> None:
    """Every row recomputed by the plain-Python definition (a margin that calls every decision close) keeps the
    same ids as the vectorised path."""
    logits = tied_rows(24, 3000, seed=3)
    fast = kept_sets(logits, temperature=0.8, top_k=top_k, top_p=top_p)
    monkeypatch.setattr(candidates, "MARGIN", float("inf"))
    assert kept_sets(logits, temperature=0.8, top_k=top_k, top_p=top_p) == fast


@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (None, 0.9), (20, None)])
def test_the_vectorised_choice_is_the_definition(monkeypatch, top_k, top_p) -> None:
    """Every row's choice made again with the reference noise (a margin that calls every choice close): the same
    tokens."""
    logits = tied_rows(16, 2000, seed=4)
    rule = SamplingRule(temperature=0.9, top_k=top_k, top_p=top_p, seed=77)
    fast = pick(logits, rule, range(16))
    monkeypatch.setattr(sampling, "SCORE_MARGIN", float("inf"))
    assert pick(logits, rule, range(16)) == fast


def test_equal_scores_go_to_the_lowest_id() -> None:
    inf = float("inf")
    logits = torch.tensor([[0.0, inf, 1.0, inf, 2.0]])
    for rule in (GREEDY, *(SamplingRule(temperature=1.0, seed=s) for s in range(5))):
        assert pick(logits, rule, [0]) == [1]
    assert pick(torch.full((1, 4), -inf), SamplingRule(temperature=1.0, seed=3), [0]) == [0]


@pytest.mark.parametrize(
    "rule",
    [
        SamplingRule(temperature=1e-6, seed=9),
        SamplingRule(temperature=GREEDY_TEMPERATURE / 2, top_p=0.9, seed=9),
        SamplingRule(temperature=1.0, top_k=1, seed=9),
        SamplingRule(temperature=0.8, top_p=1e-9, seed=9),
        SamplingRule(temperature=1.5, top_k=1, top_p=0.3, seed=9),
    ],
)
def test_settings_that_reduce_to_one_token_are_greedy(rule) -> None:
    """Ties at the top go to the lowest id, as the argmax: never to the noise (18 of 36 runs differed on int4)."""
    logits = tied_rows(200, 500, seed=5, spread=1.0)
    logits[:, 7] = logits[:, 3] = logits.max(dim=-1).values + 1.0  # ids 3 and 7 tie at the top of every row
    greedy = pick(logits, GREEDY, range(200))
    assert greedy == [3] * 200
    for offset in (0, 1000):
        assert pick(logits, rule, range(offset, offset + 200)) == greedy
    probs = logits_to_probs(logits[:2], temperature=max(rule.temperature, 1e-30), top_k=rule.top_k, top_p=rule.top_p)
    assert probs[:, 3].tolist() == [1.0, 1.0]


def test_a_temperature_at_the_greedy_bound_still_samples_among_ties() -> None:
    """From GREEDY_TEMPERATURE up the row is sampled: ids tied at the top are drawn alike (p' gives them equal
    mass), the others almost never."""
    logits = torch.zeros(1, 50)
    logits[0, 10] = logits[0, 20] = 4.0
    rule = SamplingRule(temperature=GREEDY_TEMPERATURE, seed=1)
    tokens = pick(logits.expand(400, -1), rule, range(400))
    assert set(tokens) == {10, 20} and 150 < tokens.count(10) < 250
