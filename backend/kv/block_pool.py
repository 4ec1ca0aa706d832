"""Block bookkeeping for the paged KV cache: a free list and reference counts, pure Python (no torch).

Contract:
- Blocks are the ids ``0 .. num_blocks-1``; each holds ``block_size`` token slots of K/V storage (the
  storage itself lives in :mod:`specchat.backend.kv.kv_cache`).
- :meth:`BlockPool.allocate` is all or nothing: it returns ``n`` fresh blocks with refcount 1, or raises
  :class:`KVCacheFullError` and changes nothing. It hands out the *lowest* free ids, or, given
  ``prefer=b``, the run ``b, b+1, ...`` as far as those are free. Keeping a sequence's blocks a contiguous
  ascending run is what lets attention read a sequence as a zero-copy slice of the pool (the fast path);
  :meth:`first_run` finds where a new sequence's whole expected length fits in one run, so blocks still held
  by others (kept prompts) do not split it.
- :meth:`incref` shares a block (a forked sequence); :meth:`free` drops one reference and returns the block
  to the free list when none is left. Freeing a free block, or touching an id outside the pool, raises
  :class:`KVCacheUsageError` (a bug in the caller, reported as an error rather than corrupting the cache).
"""

from __future__ import annotations

import heapq

from specchat.backend.errors import KVCacheFullError, SpecchatError
from specchat.backend.limits import KV_BLOCK_SIZE


class KVCacheUsageError(SpecchatError):
    """The block pool or a sequence was misused: double free, commit beyond reserved, truncate beyond length."""


class BlockPool:
    """Free list + reference counts over ``num_blocks`` blocks of ``block_size`` tokens."""

    __slots__ = ("block_size", "num_blocks", "_refcount", "_free", "_heap")

    def __init__(self, num_blocks: int, block_size: int = KV_BLOCK_SIZE) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise KVCacheUsageError(f"BlockPool: num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise KVCacheUsageError(f"BlockPool: block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._free: set[int] = set(range(num_blocks))
        # Min-heap of candidate free ids with lazy deletion: an id taken through `prefer` stays in the heap
        # and is skipped when popped (membership in `_free` is the truth).
        self._heap: list[int] = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise KVCacheUsageError(f"block id {block_id!r} is outside the pool (0..{self.num_blocks - 1})")

    def allocate(self, n: int = 1, *, prefer: int | None = None) -> list[int]:
        """``n`` fresh blocks (refcount 1): ``prefer, prefer+1, ...`` while free, then the lowest free ids."""
        if not isinstance(n, int) or n < 0:
            raise KVCacheUsageError(f"allocate: n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise KVCacheFullError(
                f"KV cache is full: {n} more block(s) of {self.block_size} tokens needed but only "
                f"{len(self._free)} of {self.num_blocks} are free (the pool holds "
                f"{self.num_blocks * self.block_size} tokens). Start a new conversation or shorten the prompt, "
                f"or give the pair a larger context_length in models.yaml if memory allows."
            )
        out: list[int] = []
        if prefer is not None:
            b = prefer
            while len(out) < n and 0 <= b < self.num_blocks and b in self._free:
                out.append(b)
                self._free.discard(b)
                b += 1
        while len(out) < n:
            b = heapq.heappop(self._heap)
            if b in self._free:
                out.append(b)
                self._free.discard(b)
        for b in out:
            self._refcount[b] = 1
        # Stale heap entries pile up when `prefer` takes ids; rebuild before the heap grows unboundedly.
        if len(self._heap) > 2 * len(self._free) + 64:
            self._heap = sorted(self._free)
        return out

    def first_run(self, n: int) -> int | None:
        """The lowest id ``b`` with ``b .. b+n-1`` all free, or None when the free blocks hold no such run
        (a scan of the pool: call it once per sequence, not per block)."""
        if n < 1 or n > len(self._free):
            return None
        run = 0
        for b in range(self.num_blocks):
            run = run + 1 if b in self._free else 0
            if run == n:
                return b - n + 1
        return None

    def incref(self, block_id: int) -> None:
        """One more holder of ``block_id`` (a forked sequence sharing it)."""
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise KVCacheUsageError(f"incref of block {block_id}, which is free (not allocated)")
        self._refcount[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; the block goes back to the free list when its refcount reaches 0."""
        self._check_id(block_id)
        count = self._refcount[block_id]
        if count == 0:
            raise KVCacheUsageError(f"double free of block {block_id}: it is already free")
        self._refcount[block_id] = count - 1
        if count == 1:
            self._free.add(block_id)
            heapq.heappush(self._heap, block_id)

    def refcount(self, block_id: int) -> int:
        """Number of holders of ``block_id`` (0 = free)."""
        self._check_id(block_id)
        return self._refcount[block_id]

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, used={self.num_used})"
