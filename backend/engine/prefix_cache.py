"""Prompts kept across requests, per client: what `specchat serve` reuses when an agent resends its conversation.

An agent (or any OpenAI client) sends the whole conversation every turn; without this the engine read all of it
again each time. :class:`PrefixCache` keeps, after a request, its sequence's K/V (prompt and reply) as an *entry*
of the request's *scope* (a client: app/serve/routes.py names it), and hands the next request of that scope the
entry that shares the longest token prefix with its prompt, so only the rest is prefilled.

Contract:
- :meth:`PrefixCache.take` ``(scope, prompt)`` returns a :class:`Conversation` for the request: the scope's entry
  with the longest common prefix with ``prompt`` (taken out of the cache; or, when the entry holds at least
  ``PREFIX_FORK_TOKENS`` tokens past that prefix, a fork of it sharing its blocks, so the entry stays for its
  own next turn), or a new empty one. The engine then truncates it to what the prompt shares, as for a chat turn.
  Entries of other scopes are never looked at: no client reads, shortens or frees another's.
- :meth:`PrefixCache.put` ``(scope, conv)`` keeps the request's conversation as the scope's newest entry (entries
  of the scope it extends are dropped), then evicts least recently used entries, of any scope, until the blocks
  the entries hold (each counted once, however many entries share it) fit ``budget_blocks``; the last entry left
  over the budget keeps its first ``budget_blocks`` blocks. A budget of 0 keeps nothing.
- :meth:`PrefixCache.make_room` evicts entries (least recently used first) until the pool has ``blocks`` free,
  :meth:`make_run` until it has them in one run (a new request's sequence then never splits around kept blocks):
  the running request always comes first. :meth:`clear` frees every entry.

Reuse changes no number of the reply where a row's logits do not depend on its pass (the CPU native model and
the compact forward, bit for bit); on other paths a K/V computed by a decoding pass may round differently from a
prefill's, as for a chat's next turn (docs/determinism.md, "Prefill against decoding, off the native
model").
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

from specchat.backend.engine.parts import Conversation
from specchat.backend.kv.kv_cache import PagedKVCache, common_prefix_len
from specchat.backend.limits import PREFIX_FORK_TOKENS


class PrefixCache:
    """Entries per scope within ``budget_blocks`` blocks of ``cache``'s pool (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, budget_blocks: int) -> None:
        self.cache = cache
        self.budget_blocks = max(int(budget_blocks), 0)
        self._entries: OrderedDict[tuple[str, int], Conversation] = OrderedDict()  # least recently used first
        self._ids = count()

    @property
    def budget_tokens(self) -> int:
        return self.budget_blocks * self.cache.block_size

    def __len__(self) -> int:
        return len(self._entries)

    def scopes(self) -> set[str]:
        """The scopes holding at least one entry."""
        return {scope for scope, _ in self._entries}

    def entries(self, scope: str) -> list[Conversation]:
        """The scope's entries, least recently used first (tests and diagnostics)."""
        return [conv for (s, _), conv in self._entries.items() if s == scope]

    def held_blocks(self) -> int:
        """Blocks the entries hold, each counted once (entries forked from one another share blocks)."""
        return len({b for conv in self._entries.values() for b in conv.seq.block_table})

    def take(self, scope: str, prompt: list[int]) -> Conversation:
        """The conversation a request of ``scope`` with ``prompt`` starts from (see the module docstring)."""
        best_key, best_len = None, 0
        for key, conv in self._entries.items():
            if key[0] != scope:
                continue
            shared = common_prefix_len(conv.cached, prompt)
            if shared > best_len:
                best_key, best_len = key, shared
        if best_key is None:
            return Conversation(self.cache.new_sequence())
        entry = self._entries[best_key]
        if len(entry.cached) - best_len < PREFIX_FORK_TOKENS:
            del self._entries[best_key]
            return entry
        self._entries.move_to_end(best_key)  # it served a request: recently used
        return Conversation(
            entry.seq.fork(),
            list(entry.cached),
            prompt_logits=entry.prompt_logits,
            prompt_length=entry.prompt_length,
        )

    def put(self, scope: str, conv: Conversation) -> None:
        """Keep ``conv`` (its request has ended) as ``scope``'s newest entry, within the budget."""
        if self.budget_blocks == 0 or not conv.cached or len(conv.cached) != conv.seq.length:
            conv.seq.free()  # nothing to keep, or a sequence whose ids are not known exactly (never reused)
            return
        for key, old in list(self._entries.items()):
            if key[0] == scope and common_prefix_len(old.cached, conv.cached) == len(old.cached):
                old.seq.free()  # the new entry holds all of it
                del self._entries[key]
        self._entries[(scope, next(self._ids))] = conv
        while self.held_blocks() > self.budget_blocks:
            if len(self._entries) == 1:
                conv.truncate(self.budget_tokens)
                break
            self._evict_oldest()

    def make_room(self, blocks: int) -> None:
        """Evict entries, least recently used first, until ``blocks`` blocks of the pool are free (or none is left)."""
        while self._entries and self.cache.pool.num_free < blocks:
            self._evict_oldest()

    def make_run(self, blocks: int) -> None:
        """Evict entries, least recently used first, until the pool has ``blocks`` free blocks in one run (or none
        is left): a sequence split by kept blocks reads its keys by gather at every pass, not as one slice."""
        while self._entries and self.cache.pool.first_run(blocks) is None:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        self._entries.popitem(last=False)[1].seq.free()

    def clear(self) -> None:
        for conv in self._entries.values():
            conv.seq.free()
        self._entries.clear()
