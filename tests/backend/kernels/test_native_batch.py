"""Several sequences in one native pass (NativeModel.forward_batch, csrc/model_batch.cpp): every row of every
sequence bit for bit what the same rows give run alone (chains, trees, prefill chunks, sliding windows, scattered
blocks, both pool types), taps split per sequence, and clear errors."""

from __future__ import annotations

import pytest
import torch
from native_fixtures import native_ready, run, tiny_native  # noqa: F401  (a fixture)
from tiny_models import SMOLLM_ATTENTION, random_ids

from specchat.backend.kernels.native_model import PassPart

PARENTS = [-1, 0, 1, -1, 3, 0]  # a tree after the pending token (as test_native_model.py's)


def _sequences(cache, prefixes: list[list[int]], loaded):
    """Sequences holding ``prefixes``, grown in turns of 20 tokens so later ones' blocks are scattered in the pool
    (their passes read through a slot map, not one consecutive run)."""
    seqs = [cache.new_sequence() for _ in prefixes]
    done = [0] * len(prefixes)
    while any(d < len(p) for d, p in zip(done, prefixes, strict=True)):
        for i, (seq, prefix) in enumerate(zip(seqs, prefixes, strict=True)):
            chunk = prefix[done[i] : done[i] + 20]
            if chunk:
                run(loaded, seq, chunk)
                seq.commit(len(chunk))
                done[i] += len(chunk)
    return seqs


@pytest.mark.parametrize(
    "family,shape", [("llama", SMOLLM_ATTENTION), ("mistral", {}), ("qwen2", {}), ("gemma2", {}), ("phi3", {})]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_row_equals_its_solo_pass(family, shape, dtype, native_ready, tmp_path):  # noqa: F811
    _, loaded, cache = tiny_native(family, tmp_path, dtype=dtype, max_tokens=640, **shape)
    prefixes = [random_ids(n, seed=10 + n) for n in (1, 45, 30, 70, 9)]
    seqs = _sequences(cache, prefixes, loaded)
    parts = [
        (seqs[0], random_ids(1, seed=1), 1, None),  # a decoding row
        (seqs[1], random_ids(4, seed=2), 4, None),  # a chain of 3 drafts
        (seqs[2], random_ids(1 + len(PARENTS), seed=3), 1 + len(PARENTS), PARENTS),  # a tree
        (seqs[3], random_ids(37, seed=4), 1, None),  # a prefill chunk: its last row kept
        (seqs[4], random_ids(2, seed=5), 2, None),
    ]
    solo = []
    for seq, ids, keep, parents in parts:
        logits, _ = run(loaded, seq, ids, keep=keep, parents=parents)
        solo.append(logits)
        seq.truncate(seq.length)
    assert any(seq.plan(1).read_start is None for seq in seqs)  # a scattered sequence takes part
    together = loaded.native.forward_batch([PassPart(s, torch.tensor(i), k, p) for s, i, k, p in parts])
    for (logits, taps), alone, part in zip(together, solo, parts, strict=True):
        assert taps == []
        assert torch.equal(logits, alone), part[2:]
    # Row independence both ways: the batch's order does not matter either.
    for seq, *_ in parts:
        seq.truncate(seq.length)
    reverse = loaded.native.forward_batch([PassPart(s, torch.tensor(i), k, p) for s, i, k, p in reversed(parts)])
    for (logits, _), alone in zip(reverse, reversed(solo), strict=True):
        assert torch.equal(logits, alone)


def test_taps_split_per_sequence(native_ready, tmp_path):  # noqa: F811
    model, loaded, cache = tiny_native("llama", tmp_path)
    layers = model.config.num_hidden_layers
    a, b = cache.new_sequence(), cache.new_sequence()
    ids_a, ids_b = random_ids(5, seed=1), random_ids(3, seed=2)
    alone_a = run(loaded, a, ids_a, keep=2, taps=(0, layers))
    a.truncate(0)
    alone_b = run(loaded, b, ids_b, keep=1, taps=(0, layers))
    b.truncate(0)
    both = loaded.native.forward_batch(
        [PassPart(a, torch.tensor(ids_a), 2), PassPart(b, torch.tensor(ids_b), 1)], taps=(0, layers)
    )
    for (logits, taps), (want, want_taps) in zip(both, (alone_a, alone_b), strict=True):
        assert torch.equal(logits, want)
        assert all(torch.equal(t, w) for t, w in zip(taps, want_taps, strict=True))


def test_bad_batches_are_clear_errors(native_ready, tmp_path):  # noqa: F811
    _, loaded, cache = tiny_native("llama", tmp_path, max_tokens=64)
    seq = cache.new_sequence()
    with pytest.raises(ValueError, match="twice"):
        loaded.native.forward_batch([PassPart(seq, torch.tensor([1]), 1), PassPart(seq, torch.tensor([2]), 1)])
    obj = loaded.native.obj
    with pytest.raises(RuntimeError, match="segments hold 1 rows, ids 2"):
        obj.forward_batch(torch.tensor([1, 2]), torch.tensor([[1, 0, 0, 1]]), [torch.empty(0)], [torch.empty(0)], [])
    with pytest.raises(RuntimeError, match=r"\[segments, 4\]"):
        obj.forward_batch(torch.tensor([1]), torch.tensor([1, 0, 0, 1]), [torch.empty(0)], [torch.empty(0)], [])
    with pytest.raises(RuntimeError, match="keeping 3"):
        obj.forward_batch(torch.tensor([1, 2]), torch.tensor([[2, 0, 0, 3]]), [torch.empty(0)], [torch.empty(0)], [])


def test_a_long_pass_in_pieces_equals_it_whole(native_ready, tmp_path):  # noqa: F811
    """A prefill chunk run as pieces in successive passes (offset: the rows before are written, not committed)
    leaves the same K/V and gives its last row the same logits."""
    _, loaded, cache = tiny_native("llama", tmp_path, dtype=torch.bfloat16, **SMOLLM_ATTENTION)
    ids = random_ids(50, seed=9)
    whole, _ = run(loaded, cache.new_sequence(), ids, keep=1)
    seq = cache.new_sequence()
    for start in range(0, 50, 16):
        piece = torch.tensor(ids[start : start + 16])
        ((logits, _),) = loaded.native.forward_batch([PassPart(seq, piece, 1, offset=start)])
    assert seq.length == 0
    assert torch.equal(logits, whole)
