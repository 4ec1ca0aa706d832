"""Verification of a draft: keep each drafted token that equals the target's own token at its position.

Vocabulary (backend/api.py): for a draft x_0 .. x_{k-1} (k <= γ) the target pass gives k+1 rows (row i
conditions on x_0 .. x_{i-1}), and at each row the target decides its own token t_i with
:func:`specchat.backend.speculative.sampling.pick` (the argmax when greedy; otherwise the Gumbel-max choice keyed by
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specchat.backend.api import TokenSource
from specchat.backend.speculative.sampling import SamplingRule, pick


@dataclass(slots=True)
class VerifyResult:
    """What one verification emitted: ``accepted`` draft tokens, then one recovered or bonus token."""

    tokens: list[int]
    sources: list[TokenSource]
    accepted: int
    path: list[int] = field(default_factory=list)  # tree drafts: the accepted nodes' indices, root first
    tried: int | None = None  # tree drafts: positions tried (accepted, plus one if a child set was refused)

    @property
    def positions_tried(self) -> int:
        """Draft positions the target judged: a chain's ``min(accepted + 1, k)``, a tree's ``tried``."""
        if self.tried is not None:
            return self.tried
        rejected = self.sources and self.sources[-1] is TokenSource.RECOVERED
        return self.accepted + (1 if rejected else 0)


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
    return VerifyResult(
        tokens=list(draft_ids[:accepted]) + [int(target_tokens[accepted])],
        sources=[TokenSource.ACCEPTED] * accepted + [source],
        accepted=accepted,
    )


def verify(
    target_logits: torch.Tensor,  # [k+1 (or more), V] processed target logits (sliced, penalised per row)
    draft_ids: Sequence[int],  # [k]
    rule: SamplingRule,
    positions: Sequence[int],  # [k+1] the reply position each row decides (the engine: produced, produced+1, ..)
) -> VerifyResult:
    """Decide the target's tokens at rows 0..k and verify the draft against them. Rows beyond k+1 are ignored (a
    drafter that proposed fewer than γ tokens)."""
    k = len(draft_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] < k + 1 or len(positions) != k + 1:
        shape = tuple(target_logits.shape)
        raise ValueError(
            f"verify: need [{k + 1}, V] target logits and {k + 1} positions for {k} drafts, got "
            f"{shape} and {len(positions)}"
        )
    return verify_tokens(pick(target_logits[: k + 1], rule, positions), draft_ids)


def verify_tree(
    decide: Callable[[int, list[int]], int],  # (row, accepted tokens so far) -> the target's token at that row
    draft_ids: Sequence[int],  # [n] the tree's nodes
    parents: Sequence[int],  # [n] parents[i]: node i's parent index, -1 for a child of the pending token
) -> VerifyResult:
    """Follow the target's own token through a tree of drafts: from the pending token (row 0), move to the child
    whose token equals the target's token at that row, until no child does.

    Row ``i + 1`` of the pass conditions on node i and its ancestors; ``decide`` is asked only for the rows on
    the followed path (each row's repetition penalty and reply position depend on the path: its length is the
    depth). The emitted tokens are then exactly the target's tokens along its own path, as for a chain: the
    accepted nodes, then the target's token where the path stops (RECOVERED when that node had children and
    none matched, BONUS at a leaf). Two children with the same token: the first one is followed."""
    if len(parents) != len(draft_ids):
        raise ValueError(f"verify_tree: {len(draft_ids)} nodes need {len(draft_ids)} parents, got {len(parents)}")
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(draft_ids, parents)):
        if not -1 <= parent < node:
            raise ValueError(f"verify_tree: node {node}'s parent {parent} does not come before it")
        children.setdefault(parent, {}).setdefault(int(token), node)
    node = -1
    path: list[int] = []
    tokens: list[int] = []
    while True:
        token = int(decide(node + 1, tokens))
        following = children.get(node, {}).get(token)
        if following is None:
            has_children = node in children
            source = (
                TokenSource.TARGET if not draft_ids else TokenSource.RECOVERED if has_children else TokenSource.BONUS
            )
            return VerifyResult(
                tokens=tokens + [token],
                sources=[TokenSource.ACCEPTED] * len(path) + [source],
                accepted=len(path),
                path=path,
                tried=len(path) + has_children,
            )
        path.append(following)
        tokens.append(token)
        node = following
