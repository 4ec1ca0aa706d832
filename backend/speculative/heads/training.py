"""EAGLE-3's training objective with its training-time test, for one sequence of the target's own features.

A sample is a window of ``T`` positions of a conversation the target produced: token ids ``x`` [T], the target's
taps ``f`` [T, 3 * target_hidden] at each position, and at each position the target's distribution of the next
token as its ``K`` most likely target ids and their probabilities (``label_ids`` [T, K], ``label_probs`` [T, K]),
with a loss weight per position (``weights`` [T]: the reply's tokens 1, the prompt's less).

The training-time test (EAGLE-3, §3.2) runs the head ``steps`` times over the window, as drafting runs it:
step 0 reads the target's features (row t: token t+1, ``fc(f_t)``, position t) and predicts token t+2; step j
reads the head's own output of step j-1 at the same row (token t+1+j, position t+j) and predicts token t+2+j.
Step j's query at row t attends to step 0's keys of rows <= t and to its own row's keys of steps 1..j — what a
drafted node at depth j sees at inference: the committed positions and its ancestors
(``backend/speculative/heads/drafter.py``). Step j's loss is the cross-entropy of the head's draft-vocabulary
distribution against the target's (its top K, restricted to the draft vocabulary and renormalised), weighted by
``decay ** j`` (EAGLE-3's 0.8), and its accuracy is how often the head's top token is the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specchat.backend.speculative.heads.eagle3 import Eagle3Head


@dataclass(slots=True)
class StepLosses:
    loss: torch.Tensor  # the weighted sum over steps (what backward() takes)
    per_step: list[float]  # each step's mean cross-entropy
    accuracy: list[tuple[int, int]]  # each step's (top-1 right, rows counted)


def soft_targets(head: Eagle3Head, label_ids: torch.Tensor, label_probs: torch.Tensor) -> torch.Tensor:
    """[T, K] target ids + probabilities -> [T, V_draft] distributions over the draft vocabulary (rows whose
    mass falls wholly outside it are zero)."""
    draft_index = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=label_ids.device)
    in_draft = torch.nonzero(head.t2d, as_tuple=False).flatten()
    draft_index[in_draft] = torch.arange(in_draft.numel(), device=label_ids.device)
    mapped = draft_index[label_ids.long()]  # [T, K]
    probs = label_probs.float() * (mapped >= 0)
    out = torch.zeros(label_ids.shape[0], head.config.draft_vocab_size, device=label_ids.device)
    out.scatter_add_(1, mapped.clamp(min=0), probs)
    total = out.sum(-1, keepdim=True)
    return torch.where(total > 0, out / total.clamp(min=1e-12), out)


def ttt_logits(
    head: Eagle3Head,
    embed: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,  # [T] long
    taps: torch.Tensor,  # [T, 3 * target_hidden]
    steps: int,
    first_row: int = 0,
) -> list[torch.Tensor]:  # per step j: [T - 1 - j - first_row, V_draft], row t's logits of token t+2+j
    """The head's logits at every step of the training-time test (module docstring), for the rows from
    ``first_row`` on: the rows before it only lend their step-0 keys and values (the context a drafted node
    sees), which is all a row without a loss needs; skipping the rest of their work is what makes long prompts
    cheap to train on."""
    c = head.config
    rows = ids.shape[0] - 1  # row t reads token t+1
    if rows < 1 or not 0 <= first_row < rows:
        raise ValueError(f"ttt_logits: {ids.shape[0]} positions with first row {first_row}")
    with torch.no_grad():
        emb_all = embed(ids).to(head.fc.weight.dtype)  # [T, hidden], frozen (the target's)
    fused = head.fuse(taps[:rows])  # [rows, hidden]
    positions = torch.arange(rows, device=ids.device)
    rep = c.num_heads // c.num_kv_heads
    q0, k0, v0 = head.qkv(emb_all[1 : 1 + rows], fused, positions)
    keys0, values0 = k0.repeat_interleave(rep, dim=1), v0.repeat_interleave(rep, dim=1)  # [rows, heads, d]
    feature = fused[first_row:]
    keys: list[torch.Tensor] = []  # steps >= 1, the active rows' own: [active, heads, d]
    values: list[torch.Tensor] = []
    out_logits: list[torch.Tensor] = []
    for j in range(steps):
        valid = rows - j  # rows whose token t+1+j exists
        active = valid - first_row
        if active < 1:
            break
        feature = feature[:active]
        if j == 0:
            q = q0[first_row:]
        else:
            q, k, v = head.qkv(emb_all[1 + j + first_row : 1 + j + valid], feature, positions[first_row:valid] + j)
            keys.append(k.repeat_interleave(rep, dim=1))
            values.append(v.repeat_interleave(rep, dim=1))
        scores = torch.einsum("thd,shd->hts", q, keys0[:valid]) * head.scale  # [heads, active, valid]
        causal = positions[:valid][None, :] <= positions[first_row:valid][:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        own = [(q * keys[i][:active]).sum(-1).T[..., None] * head.scale for i in range(j)]  # [heads, active, 1]
        probs = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.einsum("hts,shd->thd", probs[..., :valid], values0[:valid])
        for i in range(j):
            out = out + probs[..., valid + i].T[..., None] * values[i][:active]
        feature = head.finish(feature, out.flatten(1))  # the next step reads this step's output
        out_logits.append(head.logits(feature))
    return out_logits


def ttt_losses(
    head: Eagle3Head,
    embed: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,  # [T] long
    taps: torch.Tensor,  # [T, 3 * target_hidden]
    label_ids: torch.Tensor,  # [T, K]
    label_probs: torch.Tensor,  # [T, K]
    weights: torch.Tensor,  # [T] float
    *,
    steps: int = 5,
    decay: float = 0.8,
) -> StepLosses:
    """The training-time test's losses over one window (module docstring). Rows with no weighted position at
    any step (a prompt with weight 0) are computed only as context."""
    targets = soft_targets(head, label_ids, label_probs)  # [T, Vd]: position p's distribution of token p+1
    weighted = torch.nonzero(weights > 0).flatten()
    rows = ids.shape[0] - 1
    first = min(max(0, int(weighted[0]) - steps) if weighted.numel() else rows - 1, rows - 1)
    total = torch.zeros((), device=ids.device)
    per_step: list[float] = []
    accuracy: list[tuple[int, int]] = []
    for j, logits in enumerate(ttt_logits(head, embed, ids, taps, steps, first)):
        span = slice(1 + j + first, 1 + j + first + logits.shape[0])  # position t+1+j's distribution of t+2+j
        target = targets[span]
        weight = weights[span] * (target.sum(-1) > 0)
        ce = -(target * torch.log_softmax(logits, dim=-1)).sum(-1)
        step_loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
        total = total + decay**j * step_loss
        per_step.append(float(step_loss.detach()))
        counted = weight > 0
        right = (logits.argmax(-1) == target.argmax(-1)) & counted
        accuracy.append((int(right.sum()), int(counted.sum())))
    return StepLosses(loss=total, per_step=per_step, accuracy=accuracy)


def init_weights(head: Eagle3Head, std: float = 0.02) -> None:
    """A fresh head's weights (EAGLE-3 trains from scratch): small normal projections, unit norms."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif p.dim() > 1:
                p.normal_(0.0, std)
            else:
                p.zero_()


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's reduced vocabulary from token counts [V]: the ``size`` most frequent target ids, ascending, as
    (d2t [size]: draft id i is target id i + d2t[i], t2d [V] bool)."""
    size = min(size, counts.numel())
    chosen = torch.sort(torch.topk(counts.float(), size).indices).values
    d2t = chosen - torch.arange(size)
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """The share of counted tokens inside a draft vocabulary."""
    total = float(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
