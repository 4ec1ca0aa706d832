"""Draft trees from heads: EAGLE-2's dynamic trees and Medusa's static ones, as a Draft's ``parents``.

Dynamic (EAGLE-2, Li et al., arXiv 2406.16858): each node's score is the sum of the head's log-probabilities
along its path (its estimated chance of being accepted). Depth 1 takes the root's ``top_k`` children; at each
further depth the ``top_k`` best-scoring nodes of the last depth are expanded (one head step over them all), each
offering its ``top_k`` children; the tree finally keeps the ``budget`` best-scoring nodes of all it grew. A
child scores below its parent, so a kept node's ancestors are kept too (ties go to the shallower node). Growth
stops early once no node of the newest depth can enter the best ``budget``.

Static (Medusa, Cai et al., arXiv 2401.10774): a list of paths, each a tuple of ranks (path (0, 2): the top
token of head 0, then the third-ranked token of head 1); the first ``budget`` paths whose prefixes are in the
tree are taken, in the list's order. :func:`static_paths` builds such a list when a head's config ships none.

Scores under sampling: the children of a node are ranked by the head's logits over temperature plus the
target's own Gumbel noise at the node's reply position (``backend/speculative/gumbel.py``): the first child is
then the token the target samples when the head's distribution equals the target's (a coupled draft), and
the log-softmax of those perturbed scores is the node's log-probability. Only the speed depends on this:
verification keeps exactly the target's tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specchat.backend.speculative.gumbel import gumbel_noise
from specchat.backend.speculative.sampling import SamplingRule

SAMPLED_CANDIDATES = 32  # under sampling, a row's children are chosen among its this many most likely ids


def ranked_children(
    logits: torch.Tensor,  # [r, V_draft] float32
    to_target: Callable[[torch.Tensor], torch.Tensor],  # draft ids -> target ids
    rule: SamplingRule,
    positions: Sequence[int],  # [r] the reply position of each row's children
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([r, k] target ids, [r, k] log-probabilities), best first
    """The ``k`` best children of each row (see the module docstring for sampling)."""
    if rule.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        values, ids = torch.topk(logp, k, dim=-1)
        return to_target(ids), values
    m = min(max(SAMPLED_CANDIDATES, 2 * k), logits.shape[-1])
    top, ids = torch.topk(logits, m, dim=-1)
    target = to_target(ids)
    scores = top / rule.temperature + gumbel_noise(rule.seed, positions, target).to(top.dtype)
    logp = torch.log_softmax(scores, dim=-1)
    values, order = torch.topk(logp, k, dim=-1)
    return target.gather(1, order), values


@dataclass(slots=True)
class Grown:
    """Every node a dynamic tree grew: target token, parent (-1: the root), path score and depth (1-based)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float, depth: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(depth)
        return len(self.tokens) - 1

    def best(self, budget: int) -> tuple[list[int], list[int]]:
        """The ``budget`` best nodes as (tokens, parents), parents first (breadth-first order)."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i))[:budget]
        kept = set(order)
        order = [i for i in order if self._ancestors_kept(i, kept)]
        order.sort(key=lambda i: (self.depths[i], i))
        index = {node: j for j, node in enumerate(order)}
        return [self.tokens[i] for i in order], [index.get(self.parents[i], -1) for i in order]

    def _ancestors_kept(self, node: int, kept: set[int]) -> bool:
        parent = self.parents[node]
        while parent >= 0:
            if parent not in kept:
                return False
            parent = self.parents[parent]
        return True


Expand = Callable[["Grown", list[int]], torch.Tensor]  # (tree, nodes of one depth to feed) -> [len, V_draft] logits


def grow(
    root_logits: torch.Tensor,  # [1, V_draft]
    expand: Expand,
    to_target: Callable[[torch.Tensor], torch.Tensor],
    rule: SamplingRule,
    first_position: int,  # the reply position of the depth-1 nodes
    *,
    budget: int,
    depth: int,
    top_k: int,
    stop_ids: frozenset[int] = frozenset(),
) -> Grown:
    """Grow a dynamic tree (module docstring). ``expand`` feeds nodes of one depth to the head and returns their
    children's logits; nodes whose token is in ``stop_ids`` (EOS) get no children."""
    tree = Grown()
    k = max(1, min(top_k, budget))
    ids, logp = ranked_children(root_logits, to_target, rule, [first_position], k)
    frontier = [tree.add(int(t), -1, float(s), 1) for t, s in zip(ids[0].tolist(), logp[0].tolist())]
    for d in range(2, depth + 1):
        frontier = [n for n in frontier if tree.tokens[n] not in stop_ids]
        frontier = heapq.nlargest(k, frontier, key=lambda n: tree.scores[n])
        if not frontier:
            break
        if len(tree.tokens) >= budget:
            bar = heapq.nlargest(budget, tree.scores)[-1]
            if max(tree.scores[n] for n in frontier) <= bar:
                break  # no deeper node can enter the best budget: its score is below its parent's
        logits = expand(tree, frontier)
        ids, logp = ranked_children(logits, to_target, rule, [first_position + d - 1] * len(frontier), k)
        base = torch.tensor([tree.scores[n] for n in frontier], dtype=logp.dtype)[:, None]
        total = (logp + base).flatten()
        keep = torch.topk(total, min(k, total.numel())).indices.tolist()
        flat_ids = ids.flatten().tolist()
        frontier = [tree.add(flat_ids[j], frontier[j // k], float(total[j]), d) for j in keep]
    return tree


def static_paths(
    heads: int, size: int, *, top_k: int = 10, decay: float = 0.6, rank_decay: float = 0.5
) -> list[tuple[int, ...]]:
    """A static tree of ``size`` paths over ``heads`` heads when the config ships none: the most likely paths
    under a simple model of a head's accuracy (head d's rank-r token right with probability
    decay^(d+1) · rank_decay^r; a path's probability is the product), best first (parents always before
    their children, as a product only shrinks)."""
    out: list[tuple[int, ...]] = []
    heap: list[tuple[float, tuple[int, ...]]] = [(-decay, (0,))]
    seen: set[tuple[int, ...]] = {(0,)}
    while heap and len(out) < size:
        _, path = heapq.heappop(heap)
        out.append(path)
        nexts = [path[:-1] + (path[-1] + 1,)] if path[-1] + 1 < top_k else []
        if len(path) < heads:
            nexts.append(path + (0,))
        for nxt in nexts:
            if nxt in seen:
                continue
            seen.add(nxt)
            p = 1.0
            for depth, rank in enumerate(nxt):
                p *= decay ** (depth + 1) * rank_decay**rank
            heapq.heappush(heap, (-p, nxt))
    return out


def select_static(paths: Sequence[Sequence[int]], budget: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """The first ``budget`` paths whose prefixes are taken before them, and each one's parent index."""
    taken: dict[tuple[int, ...], int] = {}
    chosen: list[tuple[int, ...]] = []
    parents: list[int] = []
    for raw in paths:
        path = tuple(int(r) for r in raw)
        if len(chosen) >= budget:
            break
        if not path or path in taken:
            continue
        parent = -1 if len(path) == 1 else taken.get(path[:-1])
        if parent is None:
            continue
        taken[path] = len(chosen)
        chosen.append(path)
        parents.append(parent)
    return chosen, parents
