"""The native model's shared attention pass (csrc/attention_pass.cpp): rows of one pass share the reading of their
common keys, so a row's logits must still be bit for bit its one-token pass's, at contexts on both sides of the
pass's blocks (8 keys scored together, 64 values summed together), with 2 to 17 rows, GQA groups of 2, 3 and 4
query heads and head sizes that split into 1 to 4 chunks of 8, sliding windows, trees of drafts, and one or two
threads (a pass this size splits its keys and output elements over the threads; a one-token pass does not)."""

from __future__ import annotations

import pytest
import torch
from native_fixtures import native_ready, one_by_one, run, tiny_native  # noqa: F401  (a fixture)
from tiny_models import SMOLLM_ATTENTION, random_ids

# rep 2, d 16 (the default); rep 3, d 64 (SmolLM2); rep 4, d 24 (three chunks of 8, a group of 3 heads and of 1).
SHAPES = {
    "default": {},
    "smollm": SMOLLM_ATTENTION,
    "rep4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_rows_alone_equal_rows_together_across_blocks(family, shape, native_ready, tmp_path):  # noqa: F811
    _, loaded, cache = tiny_native(family, tmp_path, dtype=torch.bfloat16, max_tokens=320, **SHAPES[shape])
    ids = random_ids(220, seed=11)
    seq = cache.new_sequence()
    done = 0
    for context in (0, 7, 63, 65, 129):  # around the 8-key score tiles and the 64-value blocks
        if context > done:
            run(loaded, seq, ids[done:context])
            seq.commit(context - done)
            done = context
        for n in (2, 9, 17):
            pending = ids[context : context + n]
            alone = one_by_one(loaded, seq, pending)
            together, _ = run(loaded, seq, pending)
            assert torch.equal(together, alone), (context, n)


@pytest.mark.parametrize("prefix", [20, 230])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_rows_together_do_not_depend_on_threads(family, prefix, native_ready, tmp_path):  # noqa: F811
    """17 rows after ``prefix`` tokens of SmolLM2's shape: enough work that the pass splits its steps over two
    threads; after 20 tokens a row alone is too little for that, and two threads split its KV heads instead."""
    _, loaded, cache = tiny_native(family, tmp_path, dtype=torch.bfloat16, max_tokens=320, **SMOLLM_ATTENTION)
    ids = random_ids(prefix + 17, seed=12)
    seq = cache.new_sequence()
    run(loaded, seq, ids[:prefix])
    seq.commit(prefix)
    alone = one_by_one(loaded, seq, ids[prefix:])
    one, _ = run(loaded, seq, ids[prefix:])
    torch.set_num_threads(2)
    two, _ = run(loaded, seq, ids[prefix:])
    alone_two = one_by_one(loaded, seq, ids[prefix:])
    assert torch.equal(one, alone) and torch.equal(two, alone) and torch.equal(alone_two, alone)


# 17 nodes after the pending token: a chain of 6, branches off it, and leaves under the root.
PARENTS = [-1, 0, 1, 2, 3, 4, 0, 6, 7, 1, 9, -1, 11, 12, 12, -1, 5]


def _path(parents, row):
    rows = [-1, *parents]
    path, j = [], row
    while j >= 0:
        path.append(j)
        j = rows[j] + 1 if j > 0 else -1
    return path[::-1]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_tree_rows_equal_their_chains_after_long_prefixes(family, threads, native_ready, tmp_path):  # noqa: F811
    _, loaded, cache = tiny_native(family, tmp_path, dtype=torch.bfloat16, max_tokens=320, **SMOLLM_ATTENTION)
    prefix = random_ids(200, seed=13)
    tokens = random_ids(1 + len(PARENTS), seed=14)
    seq = cache.new_sequence()
    run(loaded, seq, prefix)
    seq.commit(len(prefix))
    torch.set_num_threads(threads)
    tree, _ = run(loaded, seq, tokens, parents=PARENTS)
    torch.set_num_threads(1)
    for row in range(len(tokens)):
        path = _path(PARENTS, row)
        chain = one_by_one(loaded, seq, [tokens[j] for j in path])
        assert torch.equal(tree[row], chain[-1]), (row, path)
