"""The ids a sampled row may choose from (top-k, top-p), with every tie broken by token id, and the exact arithmetic
behind the cut. A leaf of ``sampling.py``: pure functions of one row of logits and the settings.

The rule (``docs/determinism.md`` states it for users):

- **Rank**: a row's ids are ranked by (−logit, id): the larger logit first, the lower id first among equal
  logits. bfloat16-derived logits tie exactly and often, so this order, not a kernel's, decides every cut.
- **top-k** keeps the first k ids of the rank: exactly k, a tie at the k-th logit cut by id (transformers'
  ``TopKLogitsWarper`` keeps every id tied with the k-th instead; with that rule which tied ids survive a later
  top-p cut depended on the order ``torch.topk`` returned them in, which depends on the batch).
- **top-p** (after top-k, over its survivors) keeps the ranked id j (j = 0, 1, ...) iff the ids ranked before it
  hold less than top_p of the mass: ``C_j < top_p · Z``, where w_v = exp((x_v − x_max) / T) in float64 (x the
  float32 logits, x_max the row's largest, T the temperature), Z = Σ w over the candidates (math.fsum: the
  correctly rounded sum) and C_j = w of the ranks before j summed one after another in rank order (float64).
  Rank 0 is always kept.

Exactness: the vectorised computation (``torch.exp``, ``sum``, ``cumsum``) may round w, Z and C differently from
the definition by a few units in the last place, depending on the pass's shape and the CPU's vector width. Where
any cut decision of a row lies within :data:`MARGIN` · Z of its threshold (hundreds of times those errors) the row
is recomputed by the definition in plain Python (``math.exp``, ``math.fsum``): so the kept set is a function of
the row alone, never of the rows beside it, the candidates looked at first, or the thread count.
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch

MARGIN = 1e-9  # relative to Z: a decision closer than this to its threshold is recomputed exactly
_TOP_P_STAGES = (256, 4096)  # top-p looks among this many highest-ranked ids first, then sorts the whole row


def rank(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` [n, m] (ascending within each row) reordered by (−logit, id): a stable sort on the logits keeps
    equal logits in id order."""
    vals = logits.gather(1, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order)


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:  # [n, k] ids in rank order
    """The first ``k`` ids of each row's rank: every id above the k-th largest logit, then the lowest ids tied
    with it. Exact (comparisons and integer counts only). ``logits`` [n, V] without NaN, 0 < k < V."""
    n = logits.shape[0]
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # [n, 1] the k-th largest value (exact, whatever the ties)
    above = logits > kth
    tied = logits == kth
    room = k - above.sum(-1, keepdim=True)  # [n, 1] >= 1: tied ids the cut takes, lowest first
    keep = above | (tied & (tied.cumsum(-1) <= room))
    return rank(logits, keep.nonzero()[:, 1].view(n, k))


def _ranked_prefix(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, m] ids, [n] trusted): each row's m highest logits in (−logit, id) order, and how many leading ranks
    are certainly the row's first (``torch.topk`` returns an arbitrary subset of the ids tied at its m-th value:
    ranks holding a value above it are exact). m >= V: the whole row, all exact."""
    n, vocab = logits.shape
    if m >= vocab:
        ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        return ids, torch.full((n,), vocab, dtype=torch.long, device=logits.device)
    ids = torch.sort(torch.topk(logits, m, dim=-1).indices, dim=-1).values
    ids = rank(logits, ids)
    vals = logits.gather(1, ids)
    return ids, (vals > vals[:, -1:]).sum(-1)


def _cut(
    weights: torch.Tensor,  # [n, m] float64 w of the ranked candidates
    total: torch.Tensor,  # [n] float64 Z
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n] kept count, [n] bool: some decision too close to call)
    running = weights.cumsum(-1)
    before = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=1)  # [n, m] C_j, never decreasing
    threshold = (top_p * total)[:, None]
    keep = before < threshold
    keep[:, 0] = True
    count = keep.sum(-1)
    # C never decreases along a row, so only the decisions up to the first drop can be close to the threshold.
    cols = torch.arange(weights.shape[1], device=weights.device)[None, :]
    close = ((before - threshold).abs() <= MARGIN * total[:, None]) & (cols >= 1) & (cols <= count[:, None])
    return count, close.any(-1)


def exact_top_p_count(
    row: torch.Tensor, ranked: torch.Tensor, candidates: torch.Tensor | None, temperature: float, top_p: float
) -> int:
    """The definition (module docstring) for one row: how many of ``ranked`` (ids in rank order, at least every
    kept one) top-p keeps. ``candidates``: the ids Z sums over; None: ``ranked`` itself."""
    values = row.double()
    top = float(values[ranked[0]])
    ranked_weight = [math.exp((x - top) / temperature) for x in values[ranked].tolist()]
    pool = (
        ranked_weight
        if candidates is None
        else [math.exp((x - top) / temperature) for x in values[candidates].tolist()]
    )
    threshold = top_p * math.fsum(pool)
    count = 1
    for before in accumulate(ranked_weight[:-1]):
        if not before < threshold:
            break
        count += 1
    return count


def ranked_candidates(
    logits: torch.Tensor,  # [n, V] float32, sliced to the tokenizer's ids, penalised, without NaN
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # ([n, m] ids in rank order, [n, m] bool kept) or None
    """The ids top-k / top-p keep per row (module docstring), or None when neither filter is on (every id is a
    candidate). ``temperature`` > 0 (it weighs the mass top-p cuts)."""
    n, vocab = logits.shape
    k = top_k if top_k is not None and 0 < top_k < vocab else None
    p = top_p if top_p is not None and top_p < 1.0 else None
    if k is not None:
        ids = top_k_ids(logits, k)
        if p is None:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        weights = _weights(logits, ids, temperature)
        count, close = _cut(weights, weights.sum(-1), p)
        for row in close.nonzero()[:, 0].tolist():
            count[row] = exact_top_p_count(logits[row], ids[row], None, temperature, p)
        return ids, torch.arange(k, device=ids.device)[None, :] < count[:, None]
    if p is None:
        return None  # neither filter is on
    x = logits.double()
    total = torch.exp((x - x.max(dim=-1, keepdim=True).values) / temperature).sum(-1)  # [n] Z over every id
    for m in _TOP_P_STAGES:
        if m >= vocab:
            break
        kept = _top_p_stage(logits, m, total, temperature, p)
        if kept is not None:
            return kept
    return _top_p_stage(logits, vocab, total, temperature, p)


def _weights(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, m] float64 w of ``ids`` (ranked: column 0 holds the row's largest logit)."""
    vals = logits.gather(1, ids).double()
    return torch.exp((vals - vals[:, :1]) / temperature)


def _top_p_stage(
    logits: torch.Tensor, m: int, total: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top-p over every id, looking at the ``m`` highest-ranked ids per row; None when some row's nucleus may
    reach past the ranks known exactly there (the caller looks at more)."""
    ids, trusted = _ranked_prefix(logits, m)
    whole = m >= logits.shape[1]
    count, close = _cut(_weights(logits, ids, temperature), total, top_p)
    for row in close.nonzero()[:, 0].tolist():
        full = torch.sort(logits[row], descending=True, stable=True).indices  # the row's exact rank
        count[row] = exact_top_p_count(logits[row], full, None, temperature, top_p)
    if not whole and bool(((count >= m) | (count > trusted)).any()):
        return None
    width = int(count.max())
    return ids[:, :width], torch.arange(width, device=ids.device)[None, :] < count[:, None]
