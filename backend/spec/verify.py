"""Verification of a draft: keep each drafted token that equals the target's own token at its position.

Vocabulary (backend/api.py): for a draft x_0 .. x_{k-1} (k <= γ) the target pass gives k+1 rows (row i
conditions on x_0 .. x_{i-1}), and at each row the target decides its own token t_i with
:func:`specchat.backend.spec.sampling.pick` (the argmax when greedy; otherwise the Gumbel-max choice keyed by
(seed, reply position, token id), an exact sample from the target's processed distribution p').

- *accepted*: x_i kept because x_i == t_i (and every earlier draft was kept);
- *recovered*: at the first i with x_i != t_i, the target's token t_i;
- *bonus*: when all k are kept, t_k.

The emitted tokens are therefore t_0, t_1, ... exactly: what plain decoding with the same seed emits, whatever
was drafted and however many tokens each step verified. The draft only decides how many of them one pass
yields. This is drafter-invariant speculative decoding (Daliri et al., arXiv 2408.07978); a drafter that
picks its tokens with the same noise (the draft model does) is accepted at least (1 - TV)/(1 + TV) per token.
Candidate trees verify the same way: follow the child equal to the target's token at each depth.

An empty draft (k = 0) is a plain step: one token t_0 (source TARGET). An EOS inside the draft is just a token here: the
engine stops at the first EOS it emits. A draft id outside the target's vocabulary (a padded draft output
column) never equals a target token, so it is rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specchat.backend.api import TokenSource
from specchat.backend.spec.sampling import SamplingRule, pick


@dataclass(slots=True)
class VerifyResult:
    """What one verification emitted: ``accepted`` draft tokens, then one recovered or bonus token."""

    tokens: list[int]
    sources: list[TokenSource]
    accepted: int


def verify_tokens(target_tokens: Sequence[int], draft_ids: Sequence[int]) -> VerifyResult:
    """Accept the longest draft prefix equal to the target's own tokens, then emit the target's token at the
    first mismatch (RECOVERED) or after the last draft (BONUS). Target tokens beyond k+1 are ignored."""
    k = len(draft_ids)
    if len(target_tokens) < k + 1:
        raise ValueError(f"verify_tokens: need {k + 1} target tokens for {k} drafts, got {len(target_tokens)}")
    accepted = 0
    while accepted < k and draft_ids[accepted] == target_tokens[accepted]:
        accepted += 1
    source = TokenSource.TARGET if k == 0 else TokenSource.BONUS if accepted == k else TokenSource.RECOVERED
    return VerifyResult(tokens=list(draft_ids[:accepted]) + [int(target_tokens[accepted])],
                        sources=[TokenSource.ACCEPTED] * accepted + [source], accepted=accepted)


def verify(
    target_logits: torch.Tensor,  # [k+1 (or more), V] processed target logits (sliced, penalised per row)
    draft_ids: Sequence[int],  # [k]
    rule: SamplingRule,
    first_position: int,  # the reply position row 0 decides
) -> VerifyResult:
    """Decide the target's tokens at rows 0..k (reply positions ``first_position`` ..) and verify the draft
    against them. Rows beyond k+1 are ignored (a drafter that proposed fewer than γ tokens)."""
    k = len(draft_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] < k + 1:
        shape = tuple(target_logits.shape)
        raise ValueError(f"verify: need [{k + 1}, V] target logits for {k} drafts, got {shape}")
    targets = pick(target_logits[: k + 1], rule, range(first_position, first_position + k + 1))
    return verify_tokens(targets, draft_ids)
