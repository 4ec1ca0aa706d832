"""BlockPool: allocation order, all-or-nothing allocation, refcounts, misuse errors, and a hypothesis state
machine checking the accounting against a plain dict model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specchat.backend.errors import KVCacheFullError, SpecchatError
from specchat.backend.kv.block_pool import BlockPool, KVCacheUsageError


def test_allocates_lowest_ids_first_and_reuses_freed_ones() -> None:
    pool = BlockPool(8, block_size=16)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free(1)
    pool.free(0)
    assert pool.allocate(3) == [0, 1, 5]
    assert (pool.num_used, pool.num_free) == (6, 2)


def test_prefer_continues_a_run_then_falls_back_to_lowest() -> None:
    pool = BlockPool(10)
    first = pool.allocate(2)  # [0, 1]
    other = pool.allocate(1)  # [2] blocks the run
    pool.free(other[0])
    assert pool.allocate(2, prefer=first[-1] + 1) == [2, 3]
    blocker = pool.allocate(1)  # [4]
    assert pool.allocate(2, prefer=4) == [5, 6]  # 4 is taken: lowest free instead
    assert pool.refcount(blocker[0]) == 1


def test_full_pool_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, block_size=16)
    pool.allocate(3)
    with pytest.raises(KVCacheFullError) as err:
        pool.allocate(2)
    assert isinstance(err.value, SpecchatError)
    assert "full" in str(err.value) and "64 tokens" in str(err.value)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]


def test_refcounts_share_and_release() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref(b)
    assert pool.refcount(b) == 2
    pool.free(b)
    assert pool.num_used == 1
    pool.free(b)
    assert pool.num_used == 0 and pool.refcount(b) == 0


@pytest.mark.parametrize(
    "action",
    [
        lambda p: p.free(0),  # double free (never allocated)
        lambda p: p.incref(1),  # sharing a free block
        lambda p: p.free(99),  # outside the pool
        lambda p: p.refcount(-1),
        lambda p: p.allocate(-1),
    ],
)
def test_misuse_is_an_error(action) -> None:
    pool = BlockPool(4)
    with pytest.raises(KVCacheUsageError):
        action(pool)


def test_bad_construction_is_an_error() -> None:
    with pytest.raises(KVCacheUsageError):
        BlockPool(0)
    with pytest.raises(KVCacheUsageError):
        BlockPool(4, block_size=0)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / free against a dict of expected refcounts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(9, block_size=4)
        self.refs: dict[int, int] = {}

    @rule(n=st.integers(0, 4), prefer=st.one_of(st.none(), st.integers(0, 8)))
    def allocate(self, n: int, prefer: int | None) -> None:
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(KVCacheFullError):
                self.pool.allocate(n, prefer=prefer)
            assert self.pool.num_free == free_before
            return
        got = self.pool.allocate(n, prefer=prefer)
        assert len(got) == len(set(got)) == n
        for b in got:
            assert b not in self.refs
            self.refs[b] = 1
        if prefer is None and got:
            # Lowest first: every id below the largest one handed out is now in use.
            assert all(i in self.refs for i in range(max(got)))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data) -> None:
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.incref(b)
        self.refs[b] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data) -> None:
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.free(b)
        self.refs[b] -= 1
        if self.refs[b] == 0:
            del self.refs[b]
            with pytest.raises(KVCacheUsageError):
                self.pool.free(b)

    @invariant()
    def accounting_is_exact(self) -> None:
        assert self.pool.num_used == len(self.refs)
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks
        for b in range(self.pool.num_blocks):
            assert self.pool.refcount(b) == self.refs.get(b, 0)

    def teardown(self) -> None:
        for b, count in list(self.refs.items()):
            for _ in range(count):
                self.pool.free(b)
        assert self.pool.num_used == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
