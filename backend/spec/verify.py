"""Verification of a draft against one target pass: greedy, and lossless rejection sampling.

Vocabulary (backend/api.py; as vLLM's rejection sampler): the target's distribution is p, the drafter's q. For a
draft x_0 .. x_{k-1} (k <= γ) the target pass gives k+1 rows of p (row i conditions on x_0 .. x_{i-1}).

- *accepted*: x_i kept because it passed (greedy: x_i == argmax p_i; sampling: u < p_i(x_i) / q_i(x_i));
- *recovered*: at the first rejection i, a token drawn from the residual norm(max(0, p_i - q_i)) (greedy:
  argmax p_i);
- *bonus*: when all k pass, one token drawn from p_k.

Every step therefore emits accepted + 1 tokens, and the emitted sequence has exactly the target's distribution
whatever q is (Leviathan et al. 2023; Chen et al. 2023). An empty draft (k = 0) is a plain step: one bonus
token from p_0. An EOS inside the draft is just a token here: the engine stops at the first EOS it emits.

``draft_probs=None`` means a one-hot q (prompt lookup): x_i is accepted with probability p_i(x_i) and the
residual is p_i with x_i zeroed.

Vocabulary sizes. A target may have a padded output layer larger than the tokenizer (Qwen2.5-7B vs 0.5B), and
target and draft widths may differ. Both are compared over the common leading ids V = min(V_t, V_d[, vocab]):

- the target's p is sliced and renormalised. That equals softmax over logits whose padded columns are -inf
  only when no top-k/top-p was applied: a top-k/top-p over padded columns could have picked padded ids. The
  engine therefore slices logits to len(tokenizer) BEFORE logits_to_probs, for target and draft alike; the
  renormalisation here is a guard, not the mechanism;
- the draft's q is sliced but NOT renormalised: mass q put on ids >= V is mass on ids the target gives
  probability 0, so those drafts are always rejected (u * q < 0 never holds) and the residual max(0, p - q)
  over the common ids is the exact one. A draft id >= V is rejected the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.backend.api import TokenSource
from specchat.backend.spec.sampling import sample


@dataclass(slots=True)
class VerifyResult:
    """What one verification emitted: ``accepted`` draft tokens, then one recovered or bonus token."""

    tokens: list[int]
    sources: list[TokenSource]
    accepted: int


def _result(draft_ids: list[int], accepted: int, next_token: int) -> VerifyResult:
    source = TokenSource.BONUS if accepted == len(draft_ids) else TokenSource.RECOVERED
    return VerifyResult(
        tokens=list(draft_ids[:accepted]) + [next_token],
        sources=[TokenSource.ACCEPTED] * accepted + [source],
        accepted=accepted,
    )


def verify_greedy(
    target_logits: torch.Tensor,  # [k+1 (or more), V] target logits at the draft positions and the bonus one
    draft_ids: list[int],  # [k]
    *,
    vocab_size: int | None = None,  # compare over ids < vocab_size only (padded output columns)
) -> VerifyResult:
    """Accept the longest draft prefix equal to the target's argmax, then emit the argmax at the first mismatch
    (RECOVERED) or after the last draft (BONUS). Rows beyond k+1 are ignored."""
    k = len(draft_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] < k + 1:
        shape = tuple(target_logits.shape)
        raise ValueError(f"verify_greedy: need [{k + 1}, V] target logits for {k} drafts, got {shape}")
    logits = target_logits[: k + 1]
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    argmax = logits.argmax(dim=-1).tolist()  # one device sync
    accepted = 0
    while accepted < k and draft_ids[accepted] == argmax[accepted]:
        accepted += 1
    return _result(draft_ids, accepted, argmax[accepted])


def rejection_sample(
    target_probs: torch.Tensor,  # [B, k+1, V_t] target distributions (rows sum to 1 over V_t)
    draft_ids: torch.Tensor,  # [B, k] long
    draft_probs: torch.Tensor | None,  # [B, k, V_d] the distributions the drafts were sampled from; None: one-hot
    generator: torch.Generator | None,
    *,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] long, next_token [B] long
    """Batched rejection sampling: B independent verifications in one pass (the engine uses B = 1; the
    statistical tests run many trials at once). Returns per trial how many drafts were accepted and the token
    emitted after them (recovered where accepted < k, else bonus)."""
    batch, rows, v_t = target_probs.shape
    k = rows - 1
    if draft_ids.shape != (batch, k):
        raise ValueError(f"rejection_sample: draft_ids must be [{batch}, {k}], got {tuple(draft_ids.shape)}")
    device = target_probs.device
    vocab = v_t if draft_probs is None else min(v_t, draft_probs.shape[-1])
    if vocab_size is not None:
        vocab = min(vocab, vocab_size)
    p = target_probs[..., :vocab].float()  # [B, k+1, V]
    if vocab < v_t:
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    if k == 0:
        return torch.zeros(batch, dtype=torch.long, device=device), sample(p[:, 0], generator)

    x = draft_ids.to(device=device, dtype=torch.long)  # [B, k]
    in_vocab = x < vocab
    x_in = torch.where(in_vocab, x, 0)  # [B, k] a safe index; out-of-vocab drafts get p(x) = 0 below
    p_x = p[:, :k].gather(-1, x_in.unsqueeze(-1)).squeeze(-1) * in_vocab  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.float().gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, k] q over the draft's own width
    u = torch.rand(batch, k, generator=generator, device=device)  # [B, k]
    # u * q < p is u < p/q without dividing by zero; strict, so a token with p(x) = 0 is never accepted.
    passed = u * q_x < p_x  # [B, k]
    accepted = passed.long().cumprod(-1).sum(-1)  # [B] length of the leading run of passes

    b = torch.arange(batch, device=device)
    p_next = p[b, accepted]  # [B, V] row of the first rejection, or of the bonus position
    rejected = accepted < k  # [B]
    at = accepted.clamp(max=k - 1)  # [B] the rejected position (meaningless where nothing was rejected)
    if draft_probs is None:
        residual = p_next.clone()
        hit = rejected & in_vocab[b, at]
        residual[b[hit], x[b[hit], at[hit]]] = 0.0
    else:
        residual = (p_next - draft_probs[b, at, :vocab].float()).clamp_min(0.0)  # [B, V]
    # p == q (to rounding) leaves no residual mass although a rejection happened: then p itself is right.
    degenerate = residual.sum(-1) <= 1e-12
    use_residual = (rejected & ~degenerate).unsqueeze(-1)
    weights = torch.where(use_residual, residual, p_next)  # [B, V]
    next_token = sample(weights, generator)  # [B]
    return accepted, next_token


def verify_sampling(
    target_probs: torch.Tensor,  # [k+1, V_t] target distributions after temperature/top-k/top-p
    draft_ids: list[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, V_d] draft distributions after the same processing; None: one-hot
    generator: torch.Generator | None,
    *,
    vocab_size: int | None = None,  # compare over ids < vocab_size only
) -> VerifyResult:
    """Modified rejection sampling for one step; the emitted tokens follow the target's distribution exactly.

    Rows of ``target_probs`` beyond k+1 and of ``draft_probs`` beyond k are ignored (a drafter that proposed
    fewer than γ tokens). See the module docstring for vocabulary slicing (the engine slices logits to
    len(tokenizer) before softmax)."""
    k = len(draft_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] < k + 1:
        shape = tuple(target_probs.shape)
        raise ValueError(f"verify_sampling: need [{k + 1}, V] target probs for {k} drafts, got {shape}")
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] < k):
        raise ValueError(f"verify_sampling: need [{k}, V] draft probs for {k} drafts, got {tuple(draft_probs.shape)}")
    device = target_probs.device
    v_t = target_probs.shape[-1]
    vocab = v_t if draft_probs is None else min(v_t, draft_probs.shape[-1])
    if vocab_size is not None:
        vocab = min(vocab, vocab_size)
    # The same algorithm as rejection_sample with B = 1 (and the same random draws, in the same order), written
    # for one step: a few small ops and two device syncs instead of the batched bookkeeping.
    p = target_probs[: k + 1, :vocab].float()  # [k+1, V]
    if vocab < v_t:
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    accepted = 0
    if k:
        rows = torch.arange(k, device=device)
        x = torch.tensor(draft_ids, dtype=torch.long, device=device)  # [k]
        in_vocab = x < vocab
        p_x = p[rows, torch.where(in_vocab, x, 0)] * in_vocab  # [k]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, x].float()  # [k]
        u = torch.rand(1, k, generator=generator, device=device)[0]  # [k] drawn as rejection_sample draws it
        passed = (u * q_x < p_x).tolist()  # sync 1
        while accepted < k and passed[accepted]:
            accepted += 1
    weights = p[accepted]  # [V] the bonus row, or the rejected position's row
    if accepted < k:
        x_n = draft_ids[accepted]
        if draft_probs is None:
            residual = weights.clone()
            if x_n < vocab:
                residual[x_n] = 0.0
        else:
            residual = (weights - draft_probs[accepted, :vocab].float()).clamp_min(0.0)
        # p == q (to rounding) leaves no residual mass although a rejection happened: then p itself is right.
        weights = torch.where(residual.sum() > 1e-12, residual, weights)
    token = int(sample(weights.unsqueeze(0), generator)[0])  # sync 2
    return _result(draft_ids, accepted, token)
