"""PagedKVCache / Sequence: sizing, slot plans (zero-copy run vs gather), copy-on-write after fork, misuse
errors, and a hypothesis state machine: random reserve / commit / truncate / fork / free over several
sequences keep the block accounting exact and every sequence's K/V (and the paged attention over it) equal
to a contiguous reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_models import tiny_config

from specchat.backend.errors import KVCacheFullError
from specchat.backend.kv.attention import PagedContext, paged_attention_forward
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import PagedKVCache, kv_bytes_per_token, kv_geometry

LAYERS, HKV, HQ, D, BS = 2, 2, 4, 4, 4


def make_cache(num_blocks: int = 10) -> PagedKVCache:
    return PagedKVCache(
        num_layers=LAYERS,
        num_kv_heads=HKV,
        head_dim=D,
        num_blocks=num_blocks,
        block_size=BS,
        dtype=torch.float32,
        device="cpu",
    )


def write_tokens(cache: PagedKVCache, seq, values: torch.Tensor) -> None:
    """Reserve, write ``values`` [LAYERS, HKV, n, D] as both K and -V, and commit them."""
    n = values.shape[2]
    seq.reserve(n)
    plan = seq.plan(n)
    for layer in range(LAYERS):
        cache.write(layer, plan, values[layer][None], -values[layer][None])
    seq.commit(n)


def stored(cache: PagedKVCache, seq) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's committed K and V, [LAYERS, HKV, length, D], read slot by slot."""
    slots = torch.tensor([seq.slot(p) for p in range(seq.length)], dtype=torch.long)
    return cache.k[:, :, slots], cache.v[:, :, slots]


def reference_attention(q, k, v, *, start: int, window: int | None, softcap: float | None, scale: float):
    """Plain attention over contiguous K/V: q [HQ, n, D], k/v [HKV, kv, D] -> [n, HQ, D]."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = start + torch.arange(q.shape[1])[:, None]
    k_pos = torch.arange(k.shape[1])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def test_sizing_from_config_and_bytes_per_token() -> None:
    config = tiny_config("llama")
    assert kv_geometry(config) == (2, 2, 16)
    cache = PagedKVCache.for_model(config, max_tokens=33, block_size=16, dtype=torch.float32, device="cpu")
    assert cache.pool.num_blocks == 3 and cache.k.shape == (2, 2, 48, 16) == cache.v.shape
    per_token = kv_bytes_per_token(config, torch.bfloat16)
    assert per_token == 2 * 2 * 2 * 16 * 2


def test_single_sequence_reads_a_zero_copy_slice() -> None:
    cache = make_cache()
    seq = cache.new_sequence()
    write_tokens(cache, seq, torch.randn(LAYERS, HKV, 9, D))
    seq.reserve(3)
    plan = seq.plan(3)
    assert seq.block_table == [0, 1, 2] and plan.read_start == 0 and plan.write_start == 9
    k, _ = cache.read(1, plan)
    assert k.shape == (1, HKV, 12, D) and k.data_ptr() == cache.k[1].data_ptr()  # a view, no copy


def test_fragmented_table_gathers_the_same_values() -> None:
    cache = make_cache()
    blockers = [cache.new_sequence() for _ in range(2)]
    seq = cache.new_sequence()
    values = torch.randn(LAYERS, HKV, 10, D)
    for i in range(3):  # interleave so seq gets blocks 1, 3, 5
        write_tokens(cache, blockers[0] if i == 0 else blockers[1], torch.zeros(LAYERS, HKV, BS, D))
        write_tokens(cache, seq, values[:, :, i * BS : (i + 1) * BS] if i < 2 else values[:, :, 8:])
    assert seq.block_table == [1, 3, 5]
    seq.reserve(1)
    plan = seq.plan(1)
    assert plan.read_start is None and plan.read_slots.tolist()[-3:] == [20, 21, 22] and plan.write_start == 22
    k, v = cache.read(0, plan)
    assert torch.equal(k[0, :, :10], values[0]) and torch.equal(v[0, :, :10], -values[0])


def test_a_sequence_that_expects_its_length_starts_where_it_fits_in_one_run() -> None:
    """Blocks held by others (a kept prompt at block 2) split a new sequence that starts at the lowest free block
    (0, 1, then 3...: every later pass gathers its keys); told its expected length, it starts after them and
    stays a zero-copy run as it grows, a step at a time as decoding does."""
    for expect, table in ((None, [0, 1, 3, 4]), (16, [3, 4, 5, 6])):
        cache = make_cache()
        early, kept = cache.new_sequence(), cache.new_sequence()
        write_tokens(cache, early, torch.zeros(LAYERS, HKV, 2 * BS, D))  # blocks 0, 1
        write_tokens(cache, kept, torch.zeros(LAYERS, HKV, BS, D))  # block 2
        early.free()  # 0 and 1 free again, 2 still held
        seq = cache.new_sequence()
        if expect is not None:
            seq.expect(expect)
        write_tokens(cache, seq, torch.randn(LAYERS, HKV, 5, D))
        for _ in range(11):
            write_tokens(cache, seq, torch.randn(LAYERS, HKV, 1, D))
        assert seq.block_table == table
        seq.reserve(1)
        assert (seq.plan(1).read_start is not None) == (expect is not None)


def test_first_run_finds_the_lowest_run_of_free_blocks() -> None:
    cache = make_cache(6)
    held = cache.pool.allocate(1, prefer=2)
    assert held == [2] and cache.pool.first_run(2) == 0 and cache.pool.first_run(3) == 3
    assert cache.pool.first_run(4) is None and cache.pool.first_run(0) is None


def test_fork_shares_blocks_and_copies_on_write() -> None:
    cache = make_cache()
    parent = cache.new_sequence()
    base = torch.randn(LAYERS, HKV, 6, D)
    write_tokens(cache, parent, base)
    child = parent.fork()
    assert child.block_table == parent.block_table and cache.pool.refcount(parent.block_table[1]) == 2
    tail_p, tail_c = torch.randn(LAYERS, HKV, 3, D), torch.randn(LAYERS, HKV, 3, D)
    write_tokens(cache, parent, tail_p)  # writes into the shared half-full block 1: must copy first
    write_tokens(cache, child, tail_c)
    assert parent.block_table[0] == child.block_table[0] and parent.block_table[1] != child.block_table[1]
    assert torch.equal(stored(cache, parent)[0], torch.cat([base, tail_p], 2))
    assert torch.equal(stored(cache, child)[0], torch.cat([base, tail_c], 2))
    parent.free()
    child.free()
    assert cache.pool.num_used == 0


def test_commit_and_truncate_free_whole_blocks_only() -> None:
    cache = make_cache()
    seq = cache.new_sequence()
    seq.reserve(11)
    assert seq.capacity == 12 and cache.pool.num_used == 3
    seq.commit(5)  # speculative slots past 5 are released with their blocks
    assert seq.block_table == [0, 1] and seq.length == 5
    seq.truncate(4)
    assert seq.block_table == [0] and seq.capacity == 4
    seq.truncate(0)
    assert seq.block_table == [] and cache.pool.num_used == 0


@pytest.mark.parametrize(
    "action, message",
    [
        (lambda s: s.commit(1), "beyond reserved"),
        (lambda s: s.truncate(3), "committed length"),
        (lambda s: s.reserve(-1), "n must be"),
        (lambda s: s.plan(1), "reserve first"),
    ],
)
def test_sequence_misuse_is_an_error(action, message) -> None:
    seq = make_cache().new_sequence()
    with pytest.raises(KVCacheUsageError, match=message):
        action(seq)


def test_use_after_free_is_an_error() -> None:
    seq = make_cache().new_sequence()
    seq.reserve(2)
    seq.free()
    for action in (seq.free, lambda: seq.reserve(1), seq.fork, lambda: seq.commit(0)):
        with pytest.raises(KVCacheUsageError, match="already freed"):
            action()


def test_full_cache_raises_without_changing_anything() -> None:
    cache = make_cache(num_blocks=2)
    seq = cache.new_sequence()
    seq.reserve(5)
    with pytest.raises(KVCacheFullError, match="KV cache is full"):
        seq.reserve(9)
    assert seq.block_table == [0, 1] and cache.pool.num_used == 2


class CacheMachine(RuleBasedStateMachine):
    """Several sequences over one small pool, each mirrored by contiguous reference K/V tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(num_blocks=10)
        self.seqs: dict[int, tuple] = {}  # id -> (Sequence, ref_k, ref_v) with ref [LAYERS, HKV, length, D]
        self.next_id = 0

    def _add(self, seq, ref_k, ref_v) -> None:
        self.seqs[self.next_id] = (seq, ref_k, ref_v)
        self.next_id += 1

    @precondition(lambda self: len(self.seqs) < 4)
    @rule()
    def new_sequence(self) -> None:
        empty = torch.zeros(LAYERS, HKV, 0, D)
        self._add(self.cache.new_sequence(), empty, empty)

    @precondition(lambda self: self.seqs)
    @rule(
        data=st.data(),
        n=st.integers(1, 7),
        window=st.sampled_from([None, 1, 3, 6]),
        softcap=st.sampled_from([None, 1.5]),
        seed=st.integers(0, 2**31 - 1),
    )
    def forward_and_commit(self, data, n, window, softcap, seed) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq, ref_k, ref_v = self.seqs[sid]
        pool = self.cache.pool
        table, free = list(seq.block_table), pool.num_free
        try:
            seq.reserve(n)
        except KVCacheFullError:
            assert seq.block_table == table and pool.num_free == free
            new_blocks = max(0, math.ceil((seq.length + n) / BS) - len(table))
            shared = sum(pool.refcount(b) > 1 for b in table[seq.length // BS :])
            assert free < new_blocks + shared
            return
        gen = torch.Generator().manual_seed(seed)
        new_k, new_v = torch.randn(2, LAYERS, HKV, n, D, generator=gen)
        q = torch.randn(HQ, n, D, generator=gen)
        start = seq.length
        ctx = PagedContext(self.cache, seq.plan(n))
        for layer in range(LAYERS):
            module = SimpleNamespace(layer_idx=layer, head_dim=D)
            out, _ = paged_attention_forward(
                module,
                q[None],
                new_k[layer][None],
                new_v[layer][None],
                None,
                scaling=0.7,
                sliding_window=window,
                softcap=softcap,
                paged=ctx,
            )
            expected = reference_attention(
                q,
                torch.cat([ref_k[layer], new_k[layer]], 1),
                torch.cat([ref_v[layer], new_v[layer]], 1),
                start=start,
                window=window,
                softcap=softcap,
                scale=0.7,
            )
            torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
        keep = data.draw(st.integers(0, n))
        seq.commit(keep)
        self.seqs[sid] = (seq, torch.cat([ref_k, new_k[:, :, :keep]], 2), torch.cat([ref_v, new_v[:, :, :keep]], 2))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq, ref_k, ref_v = self.seqs[sid]
        length = data.draw(st.integers(0, seq.length))
        seq.truncate(length)
        self.seqs[sid] = (seq, ref_k[:, :, :length], ref_v[:, :, :length])

    @precondition(lambda self: self.seqs and len(self.seqs) < 4)
    @rule(data=st.data())
    def fork(self, data) -> None:
        seq, ref_k, ref_v = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        self._add(seq.fork(), ref_k.clone(), ref_v.clone())

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq, _, _ = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        seq.free()
        with pytest.raises(KVCacheUsageError):
            seq.free()

    @invariant()
    def accounting_is_exact(self) -> None:
        holders: dict[int, int] = {}
        for seq, _, _ in self.seqs.values():
            assert len(seq.block_table) == math.ceil(seq.length / BS)  # nothing reserved is left behind
            assert len(set(seq.block_table)) == len(seq.block_table)
            for b in seq.block_table:
                holders[b] = holders.get(b, 0) + 1
        pool = self.cache.pool
        assert pool.num_used == len(holders)
        for b in range(pool.num_blocks):
            assert pool.refcount(b) == holders.get(b, 0)

    @invariant()
    def contents_match_reference(self) -> None:
        for seq, ref_k, ref_v in self.seqs.values():
            k, v = stored(self.cache, seq)
            assert torch.equal(k, ref_k) and torch.equal(v, ref_v)

    def teardown(self) -> None:
        for seq, _, _ in self.seqs.values():
            seq.free()
        assert self.cache.pool.num_used == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_a_cpu_cache_takes_memory_for_the_tokens_it_holds_not_for_its_size() -> None:
    """A chat's cache is sized for the whole context but holds a conversation: on CPU its pools are zeros the
    kernel supplies on first write (torch.zeros made all of it resident: 189 MB for the embedded default)."""
    before = _rss()
    cache = PagedKVCache(
        num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=1024, block_size=16, dtype=torch.bfloat16, device="cpu"
    )  # 2 x 94 MiB
    size = cache.k.numel() * cache.k.element_size() * 2
    assert size > 180 << 20
    assert _rss() - before < size // 8
    assert not cache.k[:, :, :4096].any() and not cache.v[:, :, 8000:].any()  # reads see zeros, still lazily
    seq = cache.new_sequence()
    seq.reserve(64)
    cache.k[:, :, :64] = 1.0
    cache.v[:, :, :64] = 2.0
    seq.commit(64)
    assert _rss() - before < size // 4
    assert float(cache.k[0, 0, 63, 0]) == 1.0 and float(cache.v[29, 2, 64, 0]) == 0.0
