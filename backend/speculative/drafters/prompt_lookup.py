"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's last n-gram.

No model. The whole context (prompts and generated text, every turn) is searched, longest n-gram first
(``max_ngram`` down to ``min_ngram``); among the occurrences of that n-gram the most recent one wins (in chat
and code editing the latest copy of a passage is the one being reworked). The draft is what followed it; the
copy may run into the tokens it is itself producing (a repeating loop keeps repeating, as an LZ77 copy with
overlap does).

Draft length follows the match, as SuffixDecoding's does (``suffix.py``): the chosen occurrence's match is
measured backwards past the n-gram (``m`` tokens equal the context's end, up to ``max_match``), and the draft
is at most ``ceil(draft_factor · m + draft_offset)`` ids (and ``max_tokens``). A one-token match is a weak
guess and drafts 2 ids; a passage matching for 20 tokens is being copied and drafts up to 21. Why: a wrong long
draft costs its rows in the target's pass, and drafting by the match was the faster on code edits and chat alike
(``benchmarks/RESULTS.md``, "Machine A, Python loop"). ``draft_factor=None`` drafts ``max_tokens`` always
(classic prompt lookup).

EOS: the draft is cut *after* the first EOS id it contains; the EOS itself is kept (transformers cuts before
it). A step that finishes copying a passage can then also end the reply in the same target pass, and nothing
past an EOS (the chat template's next turn) is ever proposed. Verification treats EOS as any other token and
the engine stops at the first EOS it emits, so this costs nothing in exactness.

The search is an index, not a rescan: one dict per n-gram length from the n-gram to the position right after
its latest occurrence, updated with the ids appended since the last call. Each call checks cheaply that the
context only grew (its tail and head still equal what was indexed); if not (a new conversation, a re-rendered
or truncated one) the index is rebuilt once. A change the spot check misses could only make drafts worse,
never output wrong: every draft is verified. Cost per call: the new ids indexed, one
lookup per n-gram length and a backward match of at most ``max_match`` ids, whatever the context's length.

Worked example (also run as a unit test):

>>> drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1, eos_token_ids=(2,))
>>> context = [10, 11, 12, 13, 14, 2, 7, 10, 11, 12]
>>> drafter.propose(context, max_tokens=5).token_ids  # "10 11 12" seen at 0: copy 13 14 EOS, cut after EOS
[13, 14, 2]
>>> drafter.propose(context + [99], max_tokens=5).token_ids  # nothing ends like "... 99": no draft
[]
>>> drafter.propose([5, 6, 7, 1, 6, 8, 5, 6], max_tokens=2).token_ids  # longest first: "5 6" beats a newer "6"
[7, 1]
>>> drafter.propose([1, 3, 9, 1, 3, 4, 1, 3], max_tokens=5).token_ids  # latest "1 3" (at 3): m = 2, 3 ids
[4, 1, 3]
>>> classic = PromptLookupDrafter(max_ngram=3, min_ngram=1, draft_factor=None)
>>> classic.propose([1, 3, 9, 1, 3, 4, 1, 3], max_tokens=5).token_ids  # max_tokens always: overlapping copy
[4, 1, 3, 4, 1]
>>> passage = [11, 12, 13, 14, 15, 16]
>>> drafter.propose(passage + [9] + passage[1:] + passage, max_tokens=9).token_ids  # "12 .. 16" matches: m = 5
[11, 12, 13, 14, 15, 16]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from specchat.backend.speculative.drafters.base import Draft, StatelessHooks

# How much of the already-indexed context is re-compared each call to detect that it changed.
_CHECK_TAIL = 32
_CHECK_HEAD = 8


def _as_list(ids: Sequence[int]) -> list[int]:
    tolist = getattr(ids, "tolist", None)  # a torch tensor or numpy array slice
    return tolist() if tolist is not None else list(ids)


class PromptLookupDrafter(StatelessHooks):
    """n-gram drafter over the conversation so far (see the module docstring)."""

    name = "prompt-lookup"

    def __init__(
        self,
        *,
        max_ngram: int = 3,
        min_ngram: int = 1,
        eos_token_ids: Iterable[int] = (),
        draft_factor: float | None = 1.0,
        draft_offset: float = 1.0,
        max_match: int = 32,
    ) -> None:
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"PromptLookupDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if draft_factor is not None and not (draft_factor > 0 and draft_offset >= 0 and max_match >= max_ngram):
            raise ValueError(
                f"PromptLookupDrafter: need draft_factor > 0, draft_offset >= 0 and max_match >= "
                f"max_ngram, got {draft_factor}, {draft_offset}, {max_match}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.draft_factor, self.draft_offset, self.max_match = draft_factor, draft_offset, max_match
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._ngram_lengths = range(max_ngram, min_ngram - 1, -1)
        self.reset()

    def reset(self) -> None:
        """Forget the indexed context (a new request or conversation)."""
        self._clear()
        self.rebuilds = 0  # how often the context was found changed rather than grown (for tests/diagnostics)

    def _clear(self) -> None:
        self._ids: list[int] = []  # the context indexed so far
        # _index[n][ids[e-n:e]] = e, the latest e (< len(ids)) after that n-gram: ids[e] is its continuation.
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._ngram_lengths}

    def observe(self, num_accepted: int) -> None:
        """Nothing to adapt: accepted tokens reach the index through the next call's context."""

    def _only_grew(self, context: Sequence[int]) -> bool:
        m = len(self._ids)
        if len(context) < m:
            return False
        if m == 0:
            return True
        tail = max(0, m - _CHECK_TAIL)
        head = min(m, _CHECK_HEAD)
        return _as_list(context[tail:m]) == self._ids[tail:] and _as_list(context[:head]) == self._ids[:head]

    def _extend(self, new_ids: list[int]) -> None:
        ids = self._ids
        index = self._index
        lengths = self._ngram_lengths
        for token in new_ids:
            e = len(ids)  # the n-grams ending here now have a continuation: `token`
            for n in lengths:
                if e >= n:
                    index[n][tuple(ids[e - n : e])] = e
            ids.append(token)

    def _sync(self, context: Sequence[int]) -> None:
        if not self._only_grew(context):
            self._clear()
            self.rebuilds += 1
        if len(context) > len(self._ids):
            self._extend(_as_list(context[len(self._ids) :]))

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Up to ``max_tokens`` ids continuing ``context`` (all ids so far); an empty draft when nothing matches."""
        self._sync(context)
        ids = self._ids
        length = len(ids)
        if max_tokens <= 0:
            return Draft([])
        for n in self._ngram_lengths:
            if length < n:
                continue
            start = self._index[n].get(tuple(ids[length - n :]))
            if start is None:
                continue
            out: list[int] = []
            eos = self.eos_token_ids
            for j in range(self._draft_length(start, n, max_tokens)):
                src = start + j
                # Past the end of the context the copy continues from its own output (an overlapping copy).
                token = ids[src] if src < length else out[src - length]
                out.append(token)
                if token in eos:
                    break
            return Draft(out)
        return Draft([])

    def _draft_length(self, start: int, n: int, max_tokens: int) -> int:
        """How many ids to copy from ``start``, whose preceding ``n`` ids equal the context's end: ``max_tokens``,
        or with ``draft_factor`` the bound from the match length ``m`` (measured back up to ``max_match``)."""
        if self.draft_factor is None:
            return max_tokens
        ids, end, m = self._ids, len(self._ids), n
        while m < self.max_match and start - m > 0 and ids[start - m - 1] == ids[end - m - 1]:
            m += 1
        return min(max_tokens, math.ceil(self.draft_factor * m + self.draft_offset))
