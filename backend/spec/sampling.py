"""Logits -> probabilities -> token ids: temperature, top-k, top-p, repetition penalty, seeded sampling.

Contract (pure functions over tensors; no model, no state):

- Settings arrive checked (``specchat.backend.api.SamplingParams`` validates itself against the limits defined
  there). Temperature 0 means greedy: the engine takes the argmax and never calls :func:`logits_to_probs`.
- :func:`logits_to_probs` turns logits into the distribution that is actually sampled. The target's logits
  through it define p, the distribution speculation keeps exactly at any setting (verification corrects any
  q towards p). The draft model samples through the *same* function with the same settings (and the same
  repetition penalty) so that q stays close to p: that is what keeps acceptance high at temperature > 0.
- :func:`apply_repetition_penalty` penalises (CTRL / transformers style: positive logits divided by the penalty,
  negative ones multiplied) every id already in the context. In a verification chunk of γ+1 positions,
  position i sees the committed context *plus the draft tokens before it*; the function applies exactly that,
  row by row, in one vectorised pass, so the penalised p at each position is the one plain decoding would
  have used had it produced the same prefix.
- :func:`make_generator` gives each request its own seeded generator; :func:`sample` draws from it.

Order of operations (as transformers): repetition penalty on raw logits, then temperature, top-k, top-p.
Ties at the k-th largest logit are all kept (as transformers' TopKLogitsWarper); top-p keeps the smallest set
of most likely tokens whose mass reaches top_p (at least one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specchat.backend.errors import RequestError

_TOP_P_CANDIDATES = (256, 4096)  # top-p looks for its nucleus among this many most likely tokens first


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator for one request on ``device``. ``seed=None`` seeds it from OS entropy; the seed actually used is
    ``generator.initial_seed()`` (worth reporting so a run can be replayed)."""
    generator = torch.Generator(device=torch.device(device))
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def _ids_tensor(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long).reshape(-1)
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def apply_repetition_penalty(
    logits: torch.Tensor,  # [n, V] (or [V]) raw logits of n consecutive positions
    context_ids: Sequence[int] | torch.Tensor,  # [L] committed ids (prompt + generated) before position 0
    penalty: float | None,
    draft_ids: Sequence[int] | torch.Tensor = (),  # [n - 1] draft ids: position i also sees draft_ids[:i]
) -> torch.Tensor:
    """Penalise, at each position, the ids seen so far; returns a new tensor (float32), ``logits`` untouched.

    Row i uses the set ``context_ids ∪ draft_ids[:i]`` (each id once, however often it occurs), so in a
    verification pass over γ drafts plus one bonus position every row is penalised exactly as plain decoding
    would have. ``penalty`` None or 1.0 returns ``logits`` itself (no copy). Ids outside [0, V) are ignored.
    Pass the context as a LongTensor already on the logits' device where you can: converting a Python list of
    thousands of ids costs more than the penalty itself.
    """
    if penalty is None or penalty == 1.0:
        return logits
    squeeze = logits.dim() == 1
    rows = logits.unsqueeze(0) if squeeze else logits
    n, vocab = rows.shape
    device = rows.device
    drafts = _ids_tensor(draft_ids, device)
    if drafts.numel() != n - 1:
        raise ValueError(f"apply_repetition_penalty: {n} logit rows need {n - 1} draft ids, got {drafts.numel()}")
    ctx = _ids_tensor(context_ids, device)
    ctx = ctx[(ctx >= 0) & (ctx < vocab)]
    drafts = torch.where((drafts >= 0) & (drafts < vocab), drafts, -1)  # -1: never matches a column
    # Work on the few columns that can be penalised (ids in the context or the draft), not on all V.
    cols = torch.unique(torch.cat([ctx, drafts[drafts >= 0]]))  # [U]
    seen = torch.isin(cols, ctx).unsqueeze(0).expand(n, -1)  # [n, U] the committed context, every row
    if n > 1:
        # Row i also sees drafts[:i]: draft j marks row i iff j < i (a strictly lower-triangular pattern).
        before = torch.arange(n - 1, device=device)[None, :] < torch.arange(n, device=device)[:, None]  # [n, n-1]
        is_draft = cols[None, :] == drafts[:, None]  # [n-1, U]
        seen = seen | (before.float() @ is_draft.float() > 0)
    out = rows.to(torch.float32, copy=True)
    sub = out[:, cols]  # [n, U]
    out[:, cols] = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
    return out.squeeze(0) if squeeze else out


def logits_to_probs(
    logits: torch.Tensor,  # [n, V] (or [V]); already sliced to the tokenizer's ids and penalised
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> torch.Tensor:  # [n, V] float32, rows sum to 1
    """The sampling distribution: softmax(top_p(top_k(logits / temperature))).

    ``temperature`` must be > 0 (greedy is the engine's argmax). ``top_k`` None/0 and ``top_p`` None/1.0 disable
    those filters. Slice padded output columns off *before* calling this: top-k/top-p must only ever select
    real token ids, or the target and draft distributions would differ in ways verification cannot see.
    """
    if temperature == 0:
        raise RequestError("sampling.temperature = 0 means greedy: take the argmax instead of logits_to_probs()")
    squeeze = logits.dim() == 1
    x = (logits.unsqueeze(0) if squeeze else logits).float()  # [n, V]
    n, vocab = x.shape
    k = top_k if top_k is not None and 0 < top_k < vocab else None
    p_top = top_p if top_p is not None and top_p < 1.0 else None
    if k is None and p_top is None:
        probs = torch.softmax(x / float(temperature), dim=-1)
        return probs.squeeze(0) if squeeze else probs
    # Filtering works on a short, sorted list of candidates (vals, idx) instead of the whole vocabulary: full
    # passes over V (and above all a full sort) are what sampling costs on CPU.
    if k is not None:
        vals, idx = _top_k_with_ties(x, k)  # [n, m] descending, -inf past each row's k-th value
        vals = vals / float(temperature)
        probs_sorted = torch.softmax(vals, dim=-1)  # [n, m] the distribution after top-k
    else:
        vals, idx, probs_sorted = _nucleus_candidates(x / float(temperature), p_top or 1.0)
    if p_top is not None:
        # Keep a token while the more likely tokens hold less than top_p (the most likely one always stays).
        keep = (probs_sorted.cumsum(-1) - probs_sorted) < p_top
        keep[:, 0] = True
        vals = vals.masked_fill(~keep, float("-inf"))
    probs = torch.zeros_like(x).scatter_(1, idx, torch.softmax(vals, dim=-1))
    return probs.squeeze(0) if squeeze else probs


def _top_k_with_ties(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values per row, descending, plus any ties with the k-th (kept, as transformers does)."""
    vals, idx = torch.topk(x, k + 1, dim=-1)  # one extra tells whether the k-th value is tied beyond k
    if not bool((vals[:, k] == vals[:, k - 1]).any()):
        return vals[:, :k], idx[:, :k]
    kth = vals[:, k - 1 : k]
    m = int((x >= kth).sum(-1).max())
    vals, idx = torch.topk(x, m, dim=-1)
    return vals.masked_fill(vals < kth, float("-inf")), idx


def _nucleus_candidates(x: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The most likely tokens per row, descending, enough of them to hold top_p of every row's mass (the top
    256, else the top 4096, else the whole sorted row: a flat distribution), with their probabilities within
    the whole row."""
    vocab = x.shape[-1]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [n, 1]
    for m in _TOP_P_CANDIDATES:
        if m >= vocab:
            break
        vals, idx = torch.topk(x, m, dim=-1)
        probs = torch.exp(vals - lse)
        if not bool((probs.sum(-1) < top_p).any()):
            return vals, idx, probs
    vals, idx = torch.sort(x, dim=-1, descending=True)
    return vals, idx, torch.exp(vals - lse)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row: probs [n, V] -> [n] long (probs [V] -> a 0-d tensor). Rows need not be normalised.

    Inverse-CDF sampling: one uniform number per row against a float64 cumulative sum (exact enough that no
    id's probability moves by more than ~1e-16). torch.multinomial would draw V exponentials per row, which
    dominates a CPU decoding step at a 50k-150k vocabulary. Ids with zero probability are never returned.
    """
    rows = probs.unsqueeze(0) if probs.dim() == 1 else probs
    dtype = torch.float32 if rows.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = rows.to(dtype).cumsum(-1)  # [n, V]
    total = cdf[:, -1:]  # [n, 1]
    u = torch.rand(rows.shape[0], 1, generator=generator, device=rows.device, dtype=dtype) * total
    # u < total always, even after rounding: then the first cdf entry above u belongs to an id with mass.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    # A row without mass (all zeros or NaN: an upstream bug) would index past the end: keep the id valid.
    ids = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=rows.shape[-1] - 1)  # [n]
    return ids.squeeze(0) if probs.dim() == 1 else ids
