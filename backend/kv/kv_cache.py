"""Paged KV storage for one model: K and V pools for all layers, and per-sequence block tables.

Contract:
- ``PagedKVCache.k`` / ``.v`` are ``[num_layers, num_kv_heads, num_slots, head_dim]`` with
  ``num_slots = num_blocks * block_size``; token position ``p`` of a sequence lives in slot
  ``block_table[p // block_size] * block_size + p % block_size`` (the "slot mapping").
- A :class:`Sequence` has ``length`` committed tokens and ``capacity`` reserved slots. ``reserve(n)`` makes
  room for ``length + n`` tokens (speculative ones included), copying-on-write a block it would write into
  that a fork still shares; ``commit(n)`` keeps ``n`` more tokens; ``truncate(length)`` rolls back. Both free
  the whole blocks past the new length and copy nothing, so rejecting drafted tokens is free.
- ``fork()`` shares the committed blocks (refcounts); ``free()`` returns every block; a freed sequence
  refuses further use. Misuse raises :class:`KVCacheUsageError`; running out of blocks raises
  :class:`KVCacheFullError` before anything changes.
- ``plan(n)`` describes one forward over ``n`` new tokens at positions ``length .. length+n-1``: where to
  write them and how to read keys ``0 .. length+n-1``. When those keys sit in consecutive slots (the
  sequence's blocks form an ascending run, which the pool's allocation order makes the common case) the read
  is a zero-copy slice of the pool; otherwise a slot index tensor, built once per forward, gathers them.
"""

from __future__ import annotations

import collections.abc
import math
import mmap
from dataclasses import dataclass

import torch

from specchat.backend.kv.block_pool import BlockPool, KVCacheUsageError
from specchat.backend.limits import KV_BLOCK_SIZE


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config (the text config of multimodal ones)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_layers, num_kv_heads, head_dim


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take memory only where they are written, on CPU: an anonymous private mapping, whose pages
    the kernel supplies (zeroed) on first write. A chat's KV cache is sized for the whole context (8,192
    tokens: 189 MB for the embedded default) and a conversation fills a fraction of it; ``torch.zeros`` made
    all of it resident at start. Other devices: ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a layer's first write would otherwise fault in 2 MB, not 4 KB
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K plus V one token takes over all layers."""
    num_layers, num_kv_heads, head_dim = kv_geometry(config)
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class SlotPlan:
    """Where one forward writes its ``num_new`` tokens and how it reads keys ``0 .. kv_len-1``."""

    start: int  # position of the first new token (= committed length)
    num_new: int
    kv_len: int  # start + num_new
    write_start: int | None  # first slot when the new tokens' slots are consecutive
    write_slots: torch.Tensor | None  # [num_new] long, when they are not
    read_start: int | None  # first slot when keys 0..kv_len-1 are consecutive (zero-copy slice)
    read_slots: torch.Tensor | None  # [kv_len] long, when they are not (gather)


class PagedKVCache:
    """The K/V pools of one model plus their block pool; sequences are made with :meth:`new_sequence`."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = KV_BLOCK_SIZE,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # Zeros, not empty: a gathered read of a never-written slot must not carry NaN into 0 * V. Lazily
        # resident on CPU: memory grows with the tokens held, not with the context length.
        self.k = lazy_zeros(shape, dtype, self.device)  # [num_layers, num_kv_heads, num_slots, head_dim]
        self.v = lazy_zeros(shape, dtype, self.device)  # same
        # Per-layer [1, num_kv_heads, num_slots, head_dim] views made once, so the per-layer hot path slices
        # one view instead of building several.
        self.k_layers = [self.k[i : i + 1] for i in range(num_layers)]
        self.v_layers = [self.v[i : i + 1] for i in range(num_layers)]

    @classmethod
    def for_model(
        cls, config, *, max_tokens: int, block_size: int = KV_BLOCK_SIZE, dtype: torch.dtype, device: torch.device | str
    ) -> PagedKVCache:
        """A cache holding ``max_tokens`` tokens (rounded up to whole blocks) for a model with ``config``."""
        if max_tokens < 1:
            raise KVCacheUsageError(f"PagedKVCache.for_model: max_tokens must be >= 1, got {max_tokens}")
        num_layers, num_kv_heads, head_dim = kv_geometry(config)
        num_blocks = -(-max_tokens // block_size)
        return cls(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
        )

    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks * self.block_size

    def new_sequence(self) -> Sequence:
        return Sequence(self)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` (copy-on-write)."""
        bs = self.block_size
        # inference_mode: allowed whether the pools are normal tensors or were created under inference mode.
        with torch.inference_mode():
            self.k[:, :, dst * bs : (dst + 1) * bs].copy_(self.k[:, :, src * bs : (src + 1) * bs])
            self.v[:, :, dst * bs : (dst + 1) * bs].copy_(self.v[:, :, src * bs : (src + 1) * bs])

    def move(self, seq: Sequence, src: list[int], dst: list[int]) -> None:
        """Copy every layer's K/V of positions ``src`` of ``seq`` to positions ``dst`` (both within its reserved
        slots): the accepted path of a verified tree moves to consecutive positions. All sources are read before
        any destination is written, so the two may overlap."""
        if len(src) != len(dst):
            raise KVCacheUsageError(f"PagedKVCache.move: {len(src)} sources for {len(dst)} destinations")
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if not pairs:
            return
        for position in (p for pair in pairs for p in pair):
            if not 0 <= position < seq.capacity:
                raise KVCacheUsageError(
                    f"PagedKVCache.move: position {position} is outside the sequence's {seq.capacity} reserved slots"
                )
        source = torch.tensor([seq.slot(s) for s, _ in pairs], dtype=torch.long, device=self.device)
        target = torch.tensor([seq.slot(d) for _, d in pairs], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for pool in (self.k, self.v):
                pool.index_copy_(2, target, pool.index_select(2, source))

    def write(self, layer: int, plan: SlotPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens' K/V of ``layer``; key/value ``[1, num_kv_heads, num_new, head_dim]``."""
        k_pool, v_pool = self.k_layers[layer], self.v_layers[layer]
        if plan.write_start is not None:
            s = plan.write_start
            k_pool[:, :, s : s + plan.num_new].copy_(key)
            v_pool[:, :, s : s + plan.num_new].copy_(value)
        elif plan.write_slots is not None:
            k_pool.index_copy_(2, plan.write_slots, key.to(self.dtype))
            v_pool.index_copy_(2, plan.write_slots, value.to(self.dtype))
        else:
            raise KVCacheUsageError("PagedKVCache.write: the slot plan has neither a write run nor write slots")

    def read(self, layer: int, plan: SlotPlan, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``first .. kv_len-1`` of ``layer``, each ``[1, num_kv_heads, n, head_dim]``."""
        if plan.read_start is not None:
            a = plan.read_start + first
            b = plan.read_start + plan.kv_len
            return self.k_layers[layer][:, :, a:b], self.v_layers[layer][:, :, a:b]
        if plan.read_slots is None:
            raise KVCacheUsageError("PagedKVCache.read: the slot plan has neither a read run nor read slots")
        idx = plan.read_slots if first == 0 else plan.read_slots[first:]
        return self.k_layers[layer].index_select(2, idx), self.v_layers[layer].index_select(2, idx)


class Sequence:
    """One sequence's block table and length in a :class:`PagedKVCache`."""

    __slots__ = ("cache", "block_table", "length", "_freed", "_run", "_expect")

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.block_table: list[int] = []
        self.length = 0  # committed tokens
        self._freed = False
        self._run = True  # block_table is an ascending run b, b+1, ... (kept up to date on every change)
        self._expect = 0  # tokens the sequence is expected to reach (expect()): where its first blocks go

    def expect(self, tokens: int) -> None:
        """The sequence (empty now) will grow to about ``tokens``: its first blocks are taken where that many fit
        in one free run when the pool has one, so it stays a run (attention's zero-copy slice) as it grows,
        instead of starting at the lowest free block and breaking on the first block another sequence holds."""
        self._expect = max(int(tokens), 0)

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self.cache.block_size

    def _check_live(self, op: str) -> None:
        if self._freed:
            raise KVCacheUsageError(f"Sequence.{op}: the sequence was already freed")

    def _table_changed(self) -> None:
        bt = self.block_table
        self._run = all(bt[i + 1] == bt[i] + 1 for i in range(len(bt) - 1))

    def _release_from(self, num_blocks: int) -> None:
        """Free the blocks at table index ``num_blocks`` and beyond (last first, so they return in order)."""
        pool = self.cache.pool
        while len(self.block_table) > num_blocks:
            pool.free(self.block_table.pop())

    def reserve(self, n: int) -> None:
        """Make room for ``length + n`` tokens; blocks written by those ``n`` become private (copy-on-write)."""
        self._check_live("reserve")
        if not isinstance(n, int) or n < 0:
            raise KVCacheUsageError(f"Sequence.reserve: n must be an int >= 0, got {n!r}")
        if n == 0:
            return
        bs, pool = self.cache.block_size, self.cache.pool
        needed = -(-(self.length + n) // bs) - len(self.block_table)
        first_written = self.length // bs
        shared = [i for i in range(first_written, len(self.block_table)) if pool.refcount(self.block_table[i]) > 1]
        total = max(needed, 0) + len(shared)
        if total > pool.num_free:
            pool.allocate(total)  # raises KVCacheFullError with the numbers; nothing has changed yet
        for i in shared:
            old = self.block_table[i]
            (new,) = pool.allocate(1, prefer=self.block_table[i - 1] + 1 if i else None)
            if i * bs < self.length:  # the block holds committed tokens the fork also sees: copy them
                self.cache.copy_block(old, new)
            self.block_table[i] = new
            pool.free(old)
        if needed > 0:
            prefer = self.block_table[-1] + 1 if self.block_table else self._first_block(needed)
            self.block_table.extend(pool.allocate(needed, prefer=prefer))
        if needed > 0 or shared:
            self._table_changed()

    def _first_block(self, needed: int) -> int | None:
        """Where an empty table's first blocks go: the first run that holds the expected length (else ``needed``
        blocks), or None (the lowest free blocks)."""
        pool, expected = self.cache.pool, -(-self._expect // self.cache.block_size)
        self._expect = 0
        start = pool.first_run(expected) if expected > needed else None
        return start if start is not None else pool.first_run(needed)

    def commit(self, n: int) -> None:
        """Keep ``n`` more tokens (already written by a forward); frees whole blocks past the new length."""
        self._check_live("commit")
        if not isinstance(n, int) or n < 0:
            raise KVCacheUsageError(f"Sequence.commit: n must be an int >= 0, got {n!r}")
        if self.length + n > self.capacity:
            raise KVCacheUsageError(
                f"Sequence.commit({n}) beyond reserved slots: length {self.length} + {n} > capacity {self.capacity}"
            )
        self.length += n
        self._trim()

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` tokens (<= the committed length); frees whole blocks past it, copies nothing."""
        self._check_live("truncate")
        if not isinstance(length, int) or not 0 <= length <= self.length:
            raise KVCacheUsageError(
                f"Sequence.truncate({length!r}): must be between 0 and the committed length {self.length}"
            )
        self.length = length
        self._trim()

    def _trim(self) -> None:
        keep = -(-self.length // self.cache.block_size)
        if len(self.block_table) > keep:
            self._release_from(keep)
            if not self._run:
                self._table_changed()

    def fork(self) -> Sequence:
        """A new sequence sharing this one's committed blocks (both may then diverge; writes copy-on-write)."""
        self._check_live("fork")
        child = Sequence(self.cache)
        keep = -(-self.length // self.cache.block_size)
        child.block_table = self.block_table[:keep]
        for b in child.block_table:
            self.cache.pool.incref(b)
        child.length = self.length
        child._table_changed()
        return child

    def free(self) -> None:
        """Return every block to the pool; the sequence cannot be used afterwards."""
        self._check_live("free")
        self._release_from(0)
        self.length = 0
        self._freed = True

    def slot(self, position: int) -> int:
        """The pool slot holding token ``position`` (must be within capacity)."""
        bs = self.cache.block_size
        return self.block_table[position // bs] * bs + position % bs

    def plan(self, n: int, offset: int = 0) -> SlotPlan:
        """Slots for a forward over ``n`` new tokens at ``length + offset ..``; call after ``reserve(offset + n)``.
        ``offset``: the tokens before them are written but not committed (a long pass run in pieces)."""
        self._check_live("plan")
        start, kv_len = self.length + offset, self.length + offset + n
        if n < 1 or kv_len > self.capacity:
            raise KVCacheUsageError(
                f"Sequence.plan({n}): needs 1 <= n and length {start} + n <= capacity {self.capacity}; reserve first"
            )
        device = self.cache.device
        if self._run:
            base = self.block_table[0] * self.cache.block_size
            return SlotPlan(start, n, kv_len, base + start, None, base, None)
        # Built on the CPU from the block table (vectorised: a long context has thousands of slots), then
        # moved once; every layer of this forward reuses it.
        bs = self.cache.block_size
        table = torch.tensor(self.block_table[: -(-kv_len // bs)], dtype=torch.long)
        slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:kv_len]  # [kv_len]
        new = slots[start:]
        read_slots = slots.to(device)
        if n == 1 or bool((new[1:] - new[:-1] == 1).all()):
            return SlotPlan(start, n, kv_len, int(new[0]), None, None, read_slots)
        return SlotPlan(start, n, kv_len, None, read_slots[start:], None, read_slots)

    def __repr__(self) -> str:
        return f"Sequence(length={self.length}, capacity={self.capacity}, blocks={self.block_table})"


def common_prefix_len(a: collections.abc.Sequence[int], b: collections.abc.Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share: what a cache holding ``a`` can keep when ``b`` comes."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
