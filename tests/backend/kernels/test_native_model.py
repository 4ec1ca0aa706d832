"""The native model (backend/kernels/native_model.py, csrc/model*.cpp, csrc/attention.h) on tiny random models of
every family it runs: logits to rounding of transformers' own forward (float weights: only the summation order
differs), greedy identical; a pass's rows bit for bit equal to one-token passes (chains, prefill chunks, trees
of drafts, sliding windows, both attention versions); hidden-state taps; clear errors."""

from __future__ import annotations

import pytest
import torch
from native_fixtures import native_ready, one_by_one, run, tiny_native  # noqa: F401  (a fixture)
from tiny_models import SMOLLM_ATTENTION, random_ids

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, native_ready, tmp_path):  # noqa: F811
    model, loaded, cache = tiny_native(family, tmp_path)
    ids = random_ids(40, seed=1)
    seq = cache.new_sequence()
    logits, _ = run(loaded, seq, ids[:37])
    seq.commit(37)
    steps = []
    for token in ids[37:]:  # then decoding steps over the cache
        steps.append(run(loaded, seq, [token])[0])
        seq.commit(1)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    got = torch.cat([logits, *steps])
    assert float((got - expected).abs().max()) < 1e-4 * float(expected.std()) * 10
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_cache_stays_close(family, native_ready, tmp_path):  # noqa: F811
    model, loaded, cache = tiny_native(family, tmp_path, dtype=torch.bfloat16)
    ids = random_ids(30, seed=2)
    logits, _ = run(loaded, cache.new_sequence(), ids)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    assert float((logits - expected).abs().max()) < 0.05 * float(expected.std())


# head_dim 12 is not a multiple of 8: the portable attention (attention.h's row_scalar) runs instead of the vector one
@pytest.mark.parametrize("family,shape", [("llama", {}), ("gemma2", {}), ("llama", {"head_dim": 12})])
def test_float16_cache_is_closer_than_bfloat16(family, shape, native_ready, tmp_path):  # noqa: F811
    """A GGUF's cache is float16, as llama.cpp's: its K and V round to 11 significant bits, bfloat16's to 8."""
    errors = {}
    for dtype in (torch.float16, torch.bfloat16):
        model, loaded, cache = tiny_native(family, tmp_path / str(dtype), dtype=dtype, **shape)
        logits, _ = run(loaded, cache.new_sequence(), random_ids(30, seed=2))
        with torch.no_grad():
            expected = model(torch.tensor([random_ids(30, seed=2)])).logits[0]
        errors[dtype] = float((logits - expected).abs().max())
    assert errors[torch.float16] < errors[torch.bfloat16] / 3


def test_float16_cache_holds_each_value_rounded_to_nearest_even(native_ready, tmp_path):  # noqa: F811
    """The first layer's K and V (the same float32 values whatever the cache) stored as torch rounds them."""
    ids = random_ids(40, seed=5)
    pools = {}
    for dtype in (torch.float16, torch.float32):
        _, loaded, cache = tiny_native("llama", tmp_path / str(dtype), dtype=dtype, **SMOLLM_ATTENTION)
        seq = cache.new_sequence()
        run(loaded, seq, ids)
        slots = torch.tensor([seq.slot(p) for p in range(len(ids))])
        pools[dtype] = (cache.k[0][:, slots], cache.v[0][:, slots])
    for half, wide in zip(pools[torch.float16], pools[torch.float32]):
        assert torch.equal(half.view(torch.int16), wide.to(torch.float16).view(torch.int16))


@pytest.mark.parametrize(
    "family,shape",
    [
        ("llama", {}),
        ("llama", SMOLLM_ATTENTION),
        ("llama", {"head_dim": 12}),
        ("mistral", {}),
        ("qwen2", {}),
        ("gemma2", {}),
        ("phi3", {}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rows_equal_one_token_passes(family, shape, dtype, native_ready, tmp_path):  # noqa: F811
    _, loaded, cache = tiny_native(family, tmp_path, dtype=dtype, **shape)
    ids = random_ids(100, seed=3)
    seq = cache.new_sequence()
    run(loaded, seq, ids[:20])
    seq.commit(20)
    for n in (2, 7, 64):
        pending = ids[20 : 20 + n]
        alone = one_by_one(loaded, seq, pending)
        together, _ = run(loaded, seq, pending)
        assert torch.equal(together, alone), n


def test_prefill_rows_equal_decoding_rows(native_ready, tmp_path):  # noqa: F811
    """Prefill chunks use the same row-wise code: a 150-row pass gives each row the one-token pass's logits."""
    _, loaded, cache = tiny_native("llama", tmp_path, dtype=torch.bfloat16, max_tokens=320, **SMOLLM_ATTENTION)
    ids = random_ids(150, seed=4)
    together, _ = run(loaded, cache.new_sequence(), ids)
    alone = one_by_one(loaded, cache.new_sequence(), ids)
    assert torch.equal(together, alone)


def test_rows_do_not_depend_on_threads(native_ready, tmp_path):  # noqa: F811
    _, loaded, cache = tiny_native("llama", tmp_path, dtype=torch.bfloat16, **SMOLLM_ATTENTION)
    ids = random_ids(30, seed=5)
    one, _ = run(loaded, cache.new_sequence(), ids)
    torch.set_num_threads(2)
    two, _ = run(loaded, cache.new_sequence(), ids)
    assert torch.equal(one, two)


# A tree after the pending token (row 0): two branches of depth 3 and a leaf under the first draft.
PARENTS = [-1, 0, 1, -1, 3, 4, 0]


def _paths(parents):
    """Each row's path from the pending token (row indices), for the chain pass that must give its logits."""
    rows = [-1, *parents]
    out = []
    for i in range(len(rows)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = rows[j] + 1 if j > 0 else -1
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3"])
def test_tree_rows_equal_their_chains(family, native_ready, tmp_path):  # noqa: F811
    """Every node of a tree of drafts gets exactly the logits plain decoding of its path gives it, sliding windows
    (8 keys, after a 30-token prefix) included."""
    _, loaded, cache = tiny_native(family, tmp_path, dtype=torch.bfloat16)
    prefix = random_ids(30, seed=6)
    tokens = random_ids(1 + len(PARENTS), seed=7)
    seq = cache.new_sequence()
    run(loaded, seq, prefix)
    seq.commit(30)
    tree, _ = run(loaded, seq, tokens, parents=PARENTS)
    for row, path in enumerate(_paths(PARENTS)):
        chain = one_by_one(loaded, seq, [tokens[j] for j in path])
        assert torch.equal(tree[row], chain[-1]), (row, path)


def test_taps_are_the_residual_stream(native_ready, tmp_path):  # noqa: F811
    model, loaded, cache = tiny_native("llama", tmp_path)
    ids = random_ids(12, seed=8)
    layers = model.config.num_hidden_layers
    logits, taps = run(loaded, cache.new_sequence(), ids, keep=1, taps=(0, layers - 1, layers))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert logits.shape == (1, model.config.vocab_size)
    assert all(t.shape == (12, model.config.hidden_size) for t in taps)
    assert float((taps[0] - out.hidden_states[1][0]).abs().max()) < 1e-4
    final = model.model.norm(out.hidden_states[layers][0]) if out.hidden_states[layers] is not None else None
    assert float((taps[2] - out.hidden_states[-1][0]).abs().max()) < 1e-4 or (
        final is not None and float((taps[2] - final).abs().max()) < 1e-4
    )
    # The taps cost no second pass, and the logits are the same with or without them.
    assert torch.equal(logits, run(loaded, cache.new_sequence(), ids, keep=1)[0])


def test_bad_passes_are_clear_errors(native_ready, tmp_path):  # noqa: F811
    _, loaded, cache = tiny_native("llama", tmp_path, max_tokens=32)
    seq = cache.new_sequence()
    with pytest.raises(RuntimeError, match="token id 500"):
        run(loaded, seq, [3, 500])
    with pytest.raises(RuntimeError, match="tap 9"):
        run(loaded, cache.new_sequence(), [3, 4], taps=(9,))
    with pytest.raises(RuntimeError, match="parent"):
        loaded.native.obj.forward(torch.tensor([3, 4]), 0, 0, None, torch.tensor([-1, 5]), 1, [])


def test_an_incomplete_model_names_what_is_missing(native_ready, tmp_path):  # noqa: F811
    from dataclasses import replace

    from specchat.backend.kernels.native_model import NativeModel

    _, loaded, cache = tiny_native("llama", tmp_path)
    bare = NativeModel(replace(loaded.native.arch))
    with pytest.raises(RuntimeError, match="embedding"):
        bare.bind(cache)
