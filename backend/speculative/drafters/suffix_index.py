"""Where a token sequence has seen the end of a query before: the matching structure of the suffix drafter.

A :class:`SuffixIndex` holds token sequences (the conversation so far, or many earlier replies) and, for every
position, the ``key_len``-gram that ends there. :meth:`SuffixIndex.matches` takes the tail of a query (the
context being continued), looks up the occurrences of its last ``key_len`` tokens, measures for each how far
back the sequence before it agrees with the query (its *match length*, up to ``max_match``), and returns the
best: longest match first, the most recent among equals. What followed an occurrence is its continuation
(:meth:`continuation`), never crossing into another sequence.

This answers the question a suffix tree answers (the occurrences of the longest suffix of the query, with their
continuations) at a fraction of its memory in Python: one dictionary entry per position instead of a node per
(position, depth). The lookup costs the occurrences of one key, each compared backwards at most ``max_match``
tokens; ``max_occurrences`` bounds both (the most recent occurrences of a key are kept).

Sequences are appended to (:meth:`extend`) token by token as a conversation grows, and whole sequences are
added and dropped (:meth:`add_sequence`, :meth:`drop_oldest`) for the bounded store of earlier replies.

Worked example (also a unit test):

>>> index = SuffixIndex(key_len=2, max_match=8)
>>> seq = index.add_sequence([5, 6, 7, 1, 2, 5, 6, 7, 3, 9, 6, 7, 4])
>>> [(m.length, index.continuation(m, 3)) for m in index.matches([0, 5, 6, 7], limit=3)]
[(3, [3, 9, 6]), (3, [1, 2, 5]), (2, [4])]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Match:
    """An earlier occurrence of the query's tail: ``end`` is the position right after it in the index's token
    list (the first token of its continuation), ``length`` how many tokens before ``end`` equal the query's."""

    end: int
    length: int


class SuffixIndex:
    """Token sequences with a ``key_len``-gram index (see the module docstring)."""

    def __init__(self, *, key_len: int = 3, max_match: int = 64, max_occurrences: int = 64) -> None:
        if not (1 <= key_len <= max_match and max_occurrences >= 1):
            raise ValueError(
                f"SuffixIndex: need 1 <= key_len <= max_match and max_occurrences >= 1, got "
                f"{key_len}, {max_match}, {max_occurrences}"
            )
        self.key_len, self.max_match, self.max_occurrences = key_len, max_match, max_occurrences
        self.clear()

    def clear(self) -> None:
        self.tokens: list[int] = []  # every sequence, each followed by a separator (-1) once it is closed
        self._starts: list[int] = []  # where each live sequence starts in self.tokens
        self._index: dict[tuple[int, ...], list[int]] = {}  # key -> ends (ascending), at most max_occurrences
        self._open = False  # the last sequence may still grow (extend)

    # -- building ---------------------------------------------------------------------------------------------
    def add_sequence(self, tokens: Sequence[int]) -> int:
        """Start a new sequence (closing the previous one) holding ``tokens``; returns its number."""
        if self._open:
            self.close_sequence()
        self._starts.append(len(self.tokens))
        self._open = True
        self.extend(tokens)
        return len(self._starts) - 1

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the last (open) sequence."""
        if not self._open:
            raise ValueError("SuffixIndex.extend: no open sequence; call add_sequence first")
        ids, index, n, cap = self.tokens, self._index, self.key_len, self.max_occurrences
        start = self._starts[-1]
        for token in tokens:
            ids.append(int(token))
            end = len(ids)
            if end - start >= n:
                ends = index.setdefault(tuple(ids[end - n : end]), [])
                ends.append(end)
                if len(ends) > cap:
                    del ends[0]

    def close_sequence(self) -> None:
        """Close the open sequence: later tokens start a new one."""
        self.tokens.append(-1)  # a separator: no key contains it, no continuation crosses it
        self._open = False

    @property
    def num_sequences(self) -> int:
        return len(self._starts)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) - len(self._starts) + (1 if self._open else 0)

    def sequences(self) -> list[list[int]]:
        """Every sequence's tokens, oldest first (without the separators)."""
        out = []
        for k, start in enumerate(self._starts):
            if k + 1 < len(self._starts):
                stop = self._starts[k + 1] - 1  # a closed sequence is followed by one separator
            else:
                stop = len(self.tokens) - (0 if self._open else 1)
            out.append(self.tokens[start:stop])
        return out

    def drop_oldest(self, count: int = 1) -> None:
        """Forget the ``count`` oldest sequences (rebuilds the index from the rest)."""
        if count <= 0:
            return
        was_open, rest = self._open, self.sequences()[count:]
        self.clear()
        for tokens in rest:
            self.add_sequence(tokens)
        if rest and not was_open:
            self.close_sequence()

    # -- querying ---------------------------------------------------------------------------------------------
    def matches(self, query: Sequence[int], *, limit: int, exclude_end: int | None = None) -> list[Match]:
        """The best ``limit`` earlier occurrences of the end of ``query`` (longest match first, then the most
        recent). ``exclude_end``: an end position to skip (the query itself, when it is the indexed sequence)."""
        n = self.key_len
        if len(query) < n or limit <= 0:
            return []
        ends = self._index.get(tuple(query[-n:]))
        if not ends:
            return []
        ids, qlen, cap = self.tokens, len(query), self.max_match
        found: list[Match] = []
        for end in reversed(ends):  # most recent first: a stable sort keeps that order among equal lengths
            if end == exclude_end or end >= len(ids) or ids[end] == -1:
                continue  # nothing followed it (yet)
            length = n
            while (
                length < cap
                and length < qlen
                and end - length - 1 >= 0
                and ids[end - length - 1] == query[qlen - length - 1]
                and ids[end - length - 1] != -1
            ):
                length += 1
            found.append(Match(end, length))
        found.sort(key=lambda m: -m.length)
        return found[:limit]

    def continuation(self, match: Match, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` ids that followed ``match``, stopping at the end of its sequence."""
        out = self.tokens[match.end : match.end + max_tokens]
        if -1 in out:
            out = out[: out.index(-1)]
        return out
