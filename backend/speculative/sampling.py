"""Logits -> tokens: repetition penalty, temperature, top-k, top-p, and the seeded Gumbel-max choice.

Contract (pure functions over tensors; no model, no state). ``docs/determinism.md`` states the rule for users:

- Settings arrive checked (``specchat.backend.api.SamplingParams`` validates itself against the limits of
  ``backend/limits.py``) and travel as a :class:`SamplingRule`. **Greedy** is a temperature below
  ``GREEDY_TEMPERATURE`` (0 included) or top-k 1: the argmax, the lowest id among equal logits.
- :func:`pick` is THE function that turns one position's processed logits row and (seed, reply position) into
  the token. Sampled: the candidates are the ids top-k / top-p keep (``candidates.py``: ids ranked by (−logit,
  id), so every cut through tied logits is decided by id), and the token is the candidate with the largest
  ``logit + T · g`` (float64), g the Gumbel noise of ``gumbel.py`` keyed by (seed, position, id), the lowest id
  among equal scores. That is exactly a sample from p' = :func:`logits_to_probs` (the Gumbel-max trick), and a
  function of (the row, the seed, the position) alone: where two scores are too close for the vectorised noise
  to tell them apart (:data:`SCORE_MARGIN`), the contenders are scored again with the reference noise in plain
  Python (``gumbel.reference_gumbel``), so neither the rows beside it nor the vector width decide. The target
  decides every token with it, and verification accepts a drafted token iff it equals the target's own
  (``backend/speculative/verify.py``), so the same seed gives the same reply whatever was drafted. The draft
  model picks with the same rule and noise (coupled drafts).
- :func:`logits_to_probs` is p', the distribution :func:`pick` samples from (the tests' exact probabilities).
  Computed from ``(logits - max) / T``, so any temperature > 0 gives a finite distribution.
- :func:`apply_repetition_penalty` penalises (CTRL / transformers style: positive logits divided by the penalty,
  negative ones multiplied) every id already in the context. In a verification chunk of γ+1 positions,
  position i sees the committed context *plus the draft tokens before it*; the function applies exactly that,
  row by row, in one vectorised pass (multiplications and divisions only: exact whatever the batch). Results
  are clamped to float32's finite range (a penalty of 1e-30 cannot make an infinite logit).

Order of operations (as transformers): repetition penalty on raw logits, then temperature, top-k, top-p.
A row holding a NaN logit stops the reply with :class:`ModelOutputError`: no token is drawn from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specchat.backend.errors import ModelOutputError, RequestError
from specchat.backend.limits import GREEDY_TEMPERATURE
from specchat.backend.speculative.candidates import ranked_candidates
from specchat.backend.speculative.gumbel import gumbel_noise, reference_gumbel

# Rows of a verification whose noise is drawn at once: ~36 bytes of noise and scores per logit of a row (a
# 262,144-token vocabulary: 9 MiB a row), so a 32-row pass holds 4 rows' worth, not 32 (memory.DECISION_BYTES).
PICK_ROWS = 4
SCORE_MARGIN = 1e-9  # relative to |best score| + T: closer scores are compared again with the reference noise
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
        """The argmax decides (a temperature below GREEDY_TEMPERATURE, or top-k 1: a single candidate)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


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


def logits_to_probs(
    logits: torch.Tensor,  # [n, V] (or [V]); already sliced to the tokenizer's ids and penalised
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> torch.Tensor:  # [n, V] float32, rows sum to 1
    """p' = softmax(top_p(top_k(logits / temperature))) with ``candidates.py``'s cuts: the distribution
    :func:`pick` samples exactly. One-hot on the greedy token where :func:`pick` is greedy.

    ``temperature`` must be > 0 (0 is greedy: take the argmax). ``top_k`` None/0 and ``top_p`` None/1.0 disable
    those filters. Slice padded output columns off *before* calling this: top-k/top-p must only ever select real
    token ids."""
    if temperature <= 0:
        raise RequestError("sampling.temperature = 0 means greedy: take the argmax instead of logits_to_probs()")
    squeeze = logits.dim() == 1
    x = (logits.unsqueeze(0) if squeeze else logits).float()  # [n, V]
    if SamplingRule(temperature, top_k, top_p).greedy:
        probs = torch.zeros_like(x).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
        return probs.squeeze(0) if squeeze else probs
    kept = ranked_candidates(x, temperature=temperature, top_k=top_k, top_p=top_p)
    if kept is None:
        probs = torch.softmax((x - x.max(dim=-1, keepdim=True).values) / float(temperature), dim=-1)
    else:
        ids, keep = kept
        vals = x.gather(1, ids).masked_fill(~keep, float("-inf"))
        scaled = (vals - vals[:, :1]) / float(temperature)  # column 0 is each row's largest logit
        probs = torch.zeros_like(x).scatter_(1, ids, torch.softmax(scaled, dim=-1))
    return probs.squeeze(0) if squeeze else probs


def pick(logits: torch.Tensor, rule: SamplingRule, positions: Sequence[int]) -> list[int]:
    """The token at each row: ``logits`` [n, V] float32 (sliced, penalised), row i at reply position
    ``positions[i]`` (module docstring). Greedy: the argmax, lowest id on ties. Otherwise the kept id with the
    largest ``logit + T · g(seed, position, id)``, lowest id on ties: an exact sample from
    :func:`logits_to_probs`' p', a function of the row, the seed and the position only.

    Raises :class:`ModelOutputError` for a row holding NaN (the model produced NaN logits): never a token drawn
    from a broken distribution."""
    if logits.dim() != 2 or logits.shape[0] != len(positions):
        raise ValueError(
            f"pick: need [{len(positions)}, V] logits for {len(positions)} positions, got {tuple(logits.shape)}"
        )
    if bool(torch.isnan(logits).any()):
        raise ModelOutputError(
            "the model produced NaN logits, so no token can be chosen; the reply was stopped. "
            "This is a numerical problem of the model or its dtype: try dtype: float32 or "
            "bfloat16 for the pair in models.yaml"
        )
    if rule.greedy:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]  # ties: the first maximal index, the lowest id
    if logits.shape[0] > PICK_ROWS:  # every step is a row's own: a few rows at a time bound the noise's memory
        return [t for i in range(0, len(positions), PICK_ROWS) for t in pick(logits[i : i + PICK_ROWS], rule,
                                                                             positions[i : i + PICK_ROWS])]  # fmt: skip
    kept = ranked_candidates(logits, temperature=rule.temperature, top_k=rule.top_k, top_p=rule.top_p)
    if kept is None:
        return _gumbel_max(logits, torch.arange(logits.shape[1], device=logits.device)[None], None, rule, positions)
    ids, keep = kept
    return _gumbel_max(logits.gather(1, ids), ids, keep, rule, positions)


def _gumbel_max(
    vals: torch.Tensor,  # [n, m] the candidates' logits
    ids: torch.Tensor,  # [n, m] their ids (or [1, m] shared by every row)
    keep: torch.Tensor | None,  # [n, m] bool: candidates a filter kept (None: every column)
    rule: SamplingRule,
    positions: Sequence[int],
) -> list[int]:
    """argmax over the kept columns of ``vals + T · g``, the lowest id among equal scores (see :func:`pick`)."""
    temperature = rule.temperature
    noise = gumbel_noise(rule.seed, positions, ids)  # [n, m] float64 (float32 on MPS)
    scores = vals.to(noise.dtype) + temperature * noise
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    n, m = scores.shape
    full_ids = ids.expand(n, -1)
    at = scores.argmax(dim=-1, keepdim=True)  # the first maximal column
    tokens = [int(t) for t in full_ids.gather(1, at)[:, 0].tolist()]
    if m < 2 or noise.dtype != torch.float64:
        return tokens  # MPS: float32 noise, replayed per device type (docs/determinism.md)
    top2 = scores.topk(2, dim=-1).values  # [n, 2]
    best, second = top2[:, 0], top2[:, 1]
    separated = (best - second) > SCORE_MARGIN * (best.abs() + temperature)  # False for infinite or NaN scores
    for row in (~separated).nonzero()[:, 0].tolist():
        tokens[row] = _exact_choice(
            vals[row],
            full_ids[row],
            scores[row],
            keep[row] if keep is not None else None,
            float(best[row]),
            rule,
            positions[row],
        )
    return tokens


def _exact_choice(
    vals: torch.Tensor,  # [m] logits
    ids: torch.Tensor,  # [m]
    scores: torch.Tensor,  # [m] the vectorised scores (-inf where not kept)
    keep: torch.Tensor | None,  # [m]
    best: float,
    rule: SamplingRule,
    position: int,
) -> int:
    """The definition for a row whose best scores are too close to call with the vectorised noise: every
    contender scored with :func:`reference_gumbel` (plain Python float64), the lowest id among equal scores."""
    if math.isfinite(best):
        near = scores >= best - 2 * SCORE_MARGIN * (abs(best) + rule.temperature)
    else:
        near = scores == best  # +inf: every infinite logit; -inf: every kept candidate
    if keep is not None:
        near &= keep
    columns = near.nonzero()[:, 0]
    winner, top = -1, -math.inf
    for token, value in zip(ids[columns].tolist(), vals[columns].double().tolist()):
        score = value + rule.temperature * reference_gumbel(rule.seed, position, token)
        if score > top or (score == top and (winner < 0 or token < winner)):
            winner, top = token, score
    return winner
