"""The suffix drafter (SuffixDecoding, arXiv 2411.04975): a tree of the most frequent continuations of the longest
match of the context's end, in this conversation and in earlier replies.

Contract: ``propose(context, max_tokens)`` returns a :class:`~specchat.backend.speculative.drafters.base.Draft` of at
most ``max_tokens`` nodes with ``parents`` (a tree: ``parents[i]`` is the index of node i's parent, -1 for a
child of the pending token; a parent always comes before its children), or an empty draft when nothing matches.

How the tree is built, per call:

1. The context's end is looked up in two :class:`~specchat.backend.speculative.drafters.suffix_index.SuffixIndex`es: the
   conversation so far (kept in step with the context: appended to while it only grows, rebuilt when it
   changed), and :class:`ReplyMemory`, a bounded store of earlier replies (seeded from the local chat history
   by the caller; empty with ``--no-history``).
2. The occurrences (up to ``max_occurrences`` from each) vote with a weight that halves for every token their
   match is shorter than the longest one (the longest matches decide; a shorter match still offers its
   continuation as a branch): their continuations, up to ``depth = min(max_tokens, spec_factor · longest match
   + spec_offset, max_depth)`` tokens and cut after an EOS, are merged into a trie whose nodes sum the weights
   passing through them. A continuation of this conversation that reaches the context's end goes on copying
   what it is itself producing (an overlapping copy, as prompt lookup's), so a loop keeps drafting.
3. A node's estimated probability is its weight over the total weight (the product of the branch frequencies
   along its path). Nodes are taken best first while that is at least ``min_prob``, until ``max_tokens``
   nodes: agreeing occurrences give a chain, disagreeing ones give branches.

Verification follows the target's own token through the tree (``backend/engine/request.py``), so the tree's shape
never changes what the target says, only how many tokens a pass yields.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

from specchat.backend.speculative.drafters.base import Draft, StatelessHooks
from specchat.backend.speculative.drafters.suffix_index import Match, SuffixIndex

_CHECK_TAIL = 32  # context tokens re-compared each call to tell growth from a changed conversation


class ReplyMemory:
    """Earlier replies, bounded: at most ``max_tokens`` tokens; the oldest replies go first."""

    def __init__(self, *, max_tokens: int = 200_000, key_len: int = 3, max_match: int = 64) -> None:
        if max_tokens < 1:
            raise ValueError(f"ReplyMemory: max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.index = SuffixIndex(key_len=key_len, max_match=max_match)

    def remember(self, tokens: Sequence[int]) -> None:
        """Keep one finished reply (a reply longer than the whole budget keeps its end). When the budget is
        exceeded the oldest replies go until a quarter of it is free: dropping rebuilds the index (seconds for a
        full budget: ``benchmarks/RESULTS.md``, "Figures moved out of the code"), so it happens once per quarter
        of the budget, not at every reply."""
        tokens = list(tokens)[-self.max_tokens :]
        if not tokens:
            return
        if self.index.num_tokens + len(tokens) > self.max_tokens:
            overflow = self.index.num_tokens + len(tokens) - (self.max_tokens * 3) // 4
            dropped = count = 0
            for seq in self.index.sequences():
                if dropped >= overflow:
                    break
                dropped += len(seq)
                count += 1
            self.index.drop_oldest(count)
        self.index.add_sequence(tokens)
        self.index.close_sequence()

    def remember_all(self, replies: Iterable[Sequence[int]]) -> None:
        for reply in replies:
            self.remember(reply)

    def clear(self) -> None:
        self.index.clear()

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens


class SuffixDrafter(StatelessHooks):
    """Tree drafts from the conversation and earlier replies (see the module docstring)."""

    name = "suffix"

    def __init__(
        self,
        *,
        memory: ReplyMemory | None = None,
        eos_token_ids: Iterable[int] = (),
        key_len: int = 3,
        max_match: int = 64,
        max_occurrences: int = 16,
        max_depth: int = 32,
        spec_factor: float = 1.0,
        spec_offset: float = 2.0,
        min_prob: float = 0.1,
    ) -> None:
        self.memory = memory
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.key_len, self.max_occurrences, self.max_depth = key_len, max_occurrences, max_depth
        self.spec_factor, self.spec_offset, self.min_prob = spec_factor, spec_offset, min_prob
        self.conversation = SuffixIndex(key_len=key_len, max_match=max_match, max_occurrences=max_occurrences)
        self.last_tree: tuple[int, int] = (0, 0)  # (nodes, depth) of the last draft, for the details panel
        self.reset()

    def reset(self) -> None:
        self.conversation.clear()
        self.conversation.add_sequence([])

    def _sync(self, context: Sequence[int]) -> None:
        ids = self.conversation.tokens
        m = len(ids)
        tail = max(0, m - _CHECK_TAIL)
        grew = len(context) >= m and (m == 0 or (list(context[tail:m]) == ids[tail:] and context[0] == ids[0]))
        if not grew:
            self.reset()
        if len(context) > len(self.conversation.tokens):
            self.conversation.extend(list(context[len(self.conversation.tokens) :]))

    def _continuation(self, index: SuffixIndex, match: Match, depth: int) -> list[int]:
        if index is self.conversation:
            # Past the context's end the copy continues from its own output (an overlapping copy, as prompt
            # lookup's), so a loop keeps drafting.
            ids, length = index.tokens, len(index.tokens)
            out: list[int] = []
            for j in range(depth):
                src = match.end + j
                out.append(ids[src] if src < length else out[src - length])
        else:
            out = index.continuation(match, depth)
        for i, token in enumerate(out):
            if token in self.eos:
                return out[: i + 1]
        return out

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        self._sync(context)
        self.last_tree = (0, 0)
        if max_tokens <= 0:
            return Draft([])
        found = [
            (self.conversation, m)
            for m in self.conversation.matches(
                context, limit=self.max_occurrences, exclude_end=len(self.conversation.tokens)
            )
        ]
        if self.memory is not None:
            found += [(self.memory.index, m) for m in self.memory.index.matches(context, limit=self.max_occurrences)]
        if not found:
            return Draft([])
        best = max(m.length for _, m in found)
        depth = min(max_tokens, self.max_depth, math.ceil(self.spec_factor * best + self.spec_offset))
        # The trie of continuations: per node its token, parent and weight; children found by (parent, token).
        tokens: list[int] = []
        parents: list[int] = []
        weights: list[float] = []
        child: dict[tuple[int, int], int] = {}
        total = 0.0
        for index, match in found:
            weight = 0.5 ** (best - match.length)
            if weight < self.min_prob / 4:
                continue  # too short a match to reach min_prob even with several like it
            total += weight
            parent = -1
            for token in self._continuation(index, match, depth):
                node = child.get((parent, token))
                if node is None:
                    node = child[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                    weights.append(0.0)
                weights[node] += weight
                parent = node
        return self._select(tokens, parents, weights, total, max_tokens)

    def _select(self, tokens: list[int], parents: list[int], weights: list[float], total: float, budget: int) -> Draft:
        """The best ``budget`` nodes by estimated probability (>= min_prob; equal ones shallower first), each
        after its parent."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        heap = [(-weights[n], 1, n) for n in children.get(-1, [])]
        heapq.heapify(heap)
        order: list[int] = []
        depth_of: list[int] = []
        new_index: dict[int, int] = {}
        while heap and len(order) < budget:
            negative, depth, node = heapq.heappop(heap)
            if -negative / total < self.min_prob:
                break
            new_index[node] = len(order)
            order.append(node)
            depth_of.append(depth)
            for kid in children.get(node, []):
                heapq.heappush(heap, (-weights[kid], depth + 1, kid))
        self.last_tree = (len(order), max(depth_of, default=0))
        return Draft([tokens[n] for n in order], parents=[new_index.get(parents[n], -1) for n in order])
