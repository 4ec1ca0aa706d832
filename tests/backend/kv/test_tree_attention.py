"""Tree attention (a tree of drafts verified in one pass): every node's logits equal those of a chain pass over the
pending token and the node's own path, on every family (sliding windows and softcapping included), on
contiguous and fragmented caches; after the accepted path's K/V move to consecutive positions, decoding goes on
exactly as if that path had been fed as a chain."""

from __future__ import annotations

import pytest
import torch
from paged import paged_forward
from tiny_models import FAMILIES, WINDOW, build_tiny, random_ids

from specchat.backend.kv.attention import tree_tensors, use_paged_attention
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import PagedKVCache

TOL = 1e-4
# A tree over the pending token: two branches at the root, one of them branching again at depth 2, deeper than
# the sliding window so windowed layers drop keys inside the tree too.
PARENTS = [-1, 0, 1, 1, -1, 4, 2, 6, 7, 8, 9, 10, 11]


def _cache(model, *, fragmented: bool) -> PagedKVCache:
    cache = PagedKVCache.for_model(model.config, max_tokens=256, block_size=4, dtype=torch.float32, device="cpu")
    if fragmented:
        holders = [cache.new_sequence() for _ in range(cache.pool.num_blocks // 2)]
        for h in holders:
            h.reserve(8)
            h.commit(8)
        for h in holders:
            h.truncate(4)
    return cache


def _path(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def test_tree_tensors() -> None:
    depths, visible = tree_tensors([-1, 0, -1, 2], torch.device("cpu"))
    assert depths.tolist() == [0, 1, 2, 1, 2]
    assert visible.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, False, False, True, False],
        [True, False, False, True, True],
    ]
    with pytest.raises(KVCacheUsageError, match="parent"):
        tree_tensors([1, -1], torch.device("cpu"))  # a child before its parent


@pytest.mark.parametrize("fragmented", [False, True], ids=["run", "fragmented"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_pass_equals_a_chain_per_path_and_the_accepted_path_moves_into_place(family, fragmented) -> None:
    assert max(len(_path(PARENTS, i)) for i in range(len(PARENTS))) > WINDOW
    model = build_tiny(family)
    use_paged_attention(model)
    prefix = random_ids(30, seed=3)
    pending = prefix.pop()
    drafts = random_ids(len(PARENTS), seed=9)
    cache = _cache(model, fragmented=fragmented)
    seq = cache.new_sequence()
    paged_forward(model, seq, prefix, logits_to_keep=1)
    seq.commit(len(prefix))
    tree = paged_forward(model, seq, [pending] + drafts, logits_to_keep=1 + len(drafts), parents=PARENTS)
    for i in range(len(PARENTS)):
        chain_ids = [pending] + [drafts[j] for j in _path(PARENTS, i)]
        other = _cache(model, fragmented=False).new_sequence()
        paged_forward(model, other, prefix, logits_to_keep=1)
        other.commit(len(prefix))
        chain = paged_forward(model, other, chain_ids, logits_to_keep=len(chain_ids))
        torch.testing.assert_close(tree[1 + i], chain[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(tree[0], chain[0], atol=TOL, rtol=0)  # the pending token sees only the prefix
    # Accept the deepest path: move its K/V to consecutive positions, commit, and decode on.
    accepted = _path(PARENTS, len(PARENTS) - 1)
    start = seq.length
    cache.move(seq, [start + 1 + j for j in accepted], [start + 1 + k for k in range(len(accepted))])
    seq.commit(1 + len(accepted))
    nxt = random_ids(3, seed=5)
    got = paged_forward(model, seq, nxt, logits_to_keep=3)
    ref_seq = _cache(model, fragmented=False).new_sequence()
    want = paged_forward(model, ref_seq, prefix + [pending] + [drafts[j] for j in accepted] + nxt, logits_to_keep=3)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_move_checks_its_positions() -> None:
    model = build_tiny("llama")
    use_paged_attention(model)
    cache = _cache(model, fragmented=False)
    seq = cache.new_sequence()
    paged_forward(model, seq, random_ids(5), logits_to_keep=1)
    with pytest.raises(KVCacheUsageError, match="outside"):
        cache.move(seq, [100], [1])
    with pytest.raises(KVCacheUsageError, match="sources"):
        cache.move(seq, [1, 2], [0])
    with pytest.raises(KVCacheUsageError, match="parents"):
        paged_forward(model, seq, [5, 6, 7], parents=[-1])
