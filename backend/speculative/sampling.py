"""Logits -> tokens: repetition penalty, temperature, top-k, top-p, and the seeded Gumbel-max choice.

Contract (pure functions over tensors; no model, no state):

- Settings arrive checked (``specchat.backend.api.SamplingParams`` validates itself against the limits of
  ``backend/limits.py``) and travel as a :class:`SamplingRule`. Temperature 0 means greedy (the argmax).
- :func:`pick` is THE function that turns one position's processed logits row and (seed, reply position) into
  the token: argmax over the ids top-k/top-p keep of ``logits + T · g``, g the Gumbel noise of
  ``backend/speculative/gumbel.py`` keyed by (seed, position, id). That is exactly a sample from
  p' = :func:`logits_to_probs` (the Gumbel-max trick), and a fixed function of the seed, the position and the
  row: the target decides every token with it, and verification accepts a drafted token iff it equals the
  target's own (``backend/speculative/verify.py``), so the same seed gives the same reply whatever was drafted. The
  draft model picks with the same rule and noise (coupled drafts). ``logits + T · g`` is never divided by T,
  so a tiny temperature cannot overflow: it degrades to the argmax.
- :func:`logits_to_probs` is p', the distribution :func:`pick` samples from (the tests' exact probabilities).
  Computed from ``(logits - max) / T``, so any temperature > 0 gives a finite distribution.
- :func:`apply_repetition_penalty` penalises (CTRL / transformers style: positive logits divided by the penalty,
  negative ones multiplied) every id already in the context. In a verification chunk of γ+1 positions,
  position i sees the committed context *plus the draft tokens before it*; the function applies exactly that,
  row by row, in one vectorised pass. Results are clamped to float32's finite range (a penalty of 1e-30
  cannot make an infinite logit).

Order of operations (as transformers): repetition penalty on raw logits, then temperature, top-k, top-p.
Ties at the k-th largest logit are all kept (as transformers' TopKLogitsWarper); top-p keeps the smallest set
of most likely tokens whose mass reaches top_p (at least one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specchat.backend.errors import ModelOutputError, RequestError
from specchat.backend.speculative.gumbel import gumbel_noise

_TOP_P_CANDIDATES = (256, 4096)  # top-p looks for its nucleus among this many most likely tokens first
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True, slots=True)
class SamplingRule:
    """How a row of logits becomes a token: the request's settings (resolved and checked) and its seed."""

    temperature: float = 0.0
    top_k: int | None = None  # None: no top-k
    top_p: float | None = None  # None: no top-p
    repetition_penalty: float | None = None  # None: no penalty
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GREEDY = SamplingRule()


class SeenIds:
    """The distinct ids of a growing token sequence (the repetition penalty's context), kept incrementally.

    :meth:`sync` follows a sequence that usually only grows (a reply); when it changed in the middle (a new
    conversation) the set is rebuilt. :meth:`tensor` is a LongTensor of the ids on ``device``, rebuilt only
    after new ids arrived.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self._ids: set[int] = set()
        self._seq: list[int] = []
        self._tensor: torch.Tensor | None = None

    def add(self, ids: Iterable[int]) -> None:
        for token in ids:
            self._seq.append(token)
            if token not in self._ids:
                self._ids.add(token)
                self._tensor = None

    def sync(self, sequence: Sequence[int]) -> None:
        """Make the set that of ``sequence`` (cheap when it only grew since the last call)."""
        n = len(self._seq)
        grew = len(sequence) >= n and (n == 0 or (sequence[n - 1] == self._seq[-1] and sequence[0] == self._seq[0]))
        if not grew:
            self.clear()
            n = 0
        self.add(list(sequence[n:]))

    def __contains__(self, token: int) -> bool:
        return token in self._ids

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(sorted(self._ids), dtype=torch.long, device=self.device)
        return self._tensor


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
    penalised = torch.where(sub < 0, sub * penalty, sub / penalty).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX)
    out[:, cols] = torch.where(seen, penalised, sub)
    return out.squeeze(0) if squeeze else out


def candidates(
    logits: torch.Tensor,  # [n, V] float32, sliced to the tokenizer's ids and penalised
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # ([n, m] logits, -inf where dropped; [n, m] their ids) or None
    """The ids top-k/top-p keep per row with their (unscaled) logits, or None when every id is kept.

    Filtering works on a short, sorted list of candidates instead of the whole vocabulary: full passes over V
    (and above all a full sort) are what sampling costs on CPU. Probabilities for top-p are computed from
    ``(logits - max) / temperature`` (no overflow at any temperature > 0)."""
    n, vocab = logits.shape
    k = top_k if top_k is not None and 0 < top_k < vocab else None
    p_top = top_p if top_p is not None and top_p < 1.0 else None
    if k is None and p_top is None:
        return None
    if k is not None:
        vals, idx = _top_k_with_ties(logits, k)  # [n, m] descending, -inf past each row's k-th value
        probs_sorted = torch.softmax((vals - vals[:, :1]) / float(temperature), dim=-1)
    else:
        scaled = (logits - logits.max(dim=-1, keepdim=True).values) / float(temperature)
        _, idx, probs_sorted = _nucleus_candidates(scaled, p_top or 1.0)
        vals = logits.gather(1, idx)
    if p_top is not None:
        # Keep a token while the more likely tokens hold less than top_p (the most likely one always stays).
        keep = (probs_sorted.cumsum(-1) - probs_sorted) < p_top
        keep[:, 0] = True
        vals = vals.masked_fill(~keep, float("-inf"))
    return vals, idx


def logits_to_probs(
    logits: torch.Tensor,  # [n, V] (or [V]); already sliced to the tokenizer's ids and penalised
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> torch.Tensor:  # [n, V] float32, rows sum to 1
    """p' = softmax(top_p(top_k(logits / temperature))): the distribution :func:`pick` samples exactly.

    ``temperature`` must be > 0 (greedy is the argmax). ``top_k`` None/0 and ``top_p`` None/1.0 disable those
    filters. Slice padded output columns off *before* calling this: top-k/top-p must only ever select real
    token ids."""
    if temperature <= 0:
        raise RequestError("sampling.temperature = 0 means greedy: take the argmax instead of logits_to_probs()")
    squeeze = logits.dim() == 1
    x = (logits.unsqueeze(0) if squeeze else logits).float()  # [n, V]
    kept = candidates(x, temperature=temperature, top_k=top_k, top_p=top_p)
    if kept is None:
        probs = torch.softmax((x - x.max(dim=-1, keepdim=True).values) / float(temperature), dim=-1)
    else:
        vals, idx = kept
        scaled = (vals - vals[:, :1]) / float(temperature)  # column 0 is each row's largest logit
        probs = torch.zeros_like(x).scatter_(1, idx, torch.softmax(scaled, dim=-1))
    return probs.squeeze(0) if squeeze else probs


def pick(logits: torch.Tensor, rule: SamplingRule, positions: Sequence[int]) -> list[int]:
    """The token at each row: ``logits`` [n, V] float32 (sliced, penalised), row i at reply position
    ``positions[i]``. Greedy: the argmax. Otherwise argmax over the kept ids of ``logits + T · g(seed, position,
    id)``: an exact sample from :func:`logits_to_probs`' p', the same for a row whatever else is in the batch.

    Raises :class:`ModelOutputError` for a row whose winner is NaN (the model produced NaN logits): never a
    token drawn from a broken distribution."""
    if logits.dim() != 2 or logits.shape[0] != len(positions):
        raise ValueError(
            f"pick: need [{len(positions)}, V] logits for {len(positions)} positions, got {tuple(logits.shape)}"
        )
    if rule.greedy:
        token = logits.argmax(dim=-1)  # ties: the lowest id
        best = logits.gather(1, token[:, None])[:, 0]
    else:
        kept = candidates(logits, temperature=rule.temperature, top_k=rule.top_k, top_p=rule.top_p)
        if kept is None:
            vals, ids = logits, torch.arange(logits.shape[1], device=logits.device)[None]
        else:
            vals, ids = kept
        noise = gumbel_noise(rule.seed, positions, ids)  # [n, m] (float64; float32 on MPS)
        scores = vals.to(noise.dtype) + rule.temperature * noise  # [n, m]
        at = scores.argmax(dim=-1)
        best = scores.gather(1, at[:, None])[:, 0]
        token = at if kept is None else ids.gather(1, at[:, None])[:, 0]
    out = torch.stack([token.to(best.dtype), best]).tolist()  # one device sync
    if any(value != value for value in out[1]):  # NaN
        raise ModelOutputError(
            "the model produced NaN logits, so no token can be chosen; the reply was stopped. "
            "This is a numerical problem of the model or its dtype: try dtype: float32 or "
            "bfloat16 for the pair in models.yaml"
        )
    return [int(t) for t in out[0]]


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
