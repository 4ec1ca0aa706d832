"""The compact forward (backend/kernels/compact.py) against transformers' forward of the same quantised model."""

from __future__ import annotations

import pytest
import torch
from paged import paged_forward
from tiny_models import SMOLLM_ATTENTION, build_tiny, random_ids
from tiny_models import quantised_paged as _quantised
from tiny_models import tiny_paged_cache as _cache

from specchat.backend.kernels import compact, quant_linear
from specchat.backend.models.loading.quantized import quantize_model

# Projection widths in whole blocks of the int4 layout (32 rows with AVX2, 64 with AVX-512): q 128, k/v 64.
JOINABLE = dict(head_dim=32)


@pytest.mark.parametrize("family", compact.ARCHITECTURES)
@pytest.mark.parametrize("quantization", ["int4-torch", "int8-torch"])
def test_compact_forward_matches_transformers(family, quantization):
    model = _quantised(family, quantization, **JOINABLE)
    fast = compact.build(model)
    assert fast.layers[0].qkv is not None or quantization == "int8-torch"  # int4 projections joined
    prompt, steps = random_ids(80, seed=1), random_ids(6, seed=2)  # a prefill over the row-wise limit, then steps
    caches = [_cache(model), _cache(model)]
    seqs = [c.new_sequence() for c in caches]
    for chunk, keep in [(prompt, 3), *[([t], 1) for t in steps], (random_ids(5, seed=3), 5)]:
        ref = paged_forward(model, seqs[0], chunk, logits_to_keep=keep)
        got = paged_forward(model, seqs[1], chunk, logits_to_keep=keep, fast=fast)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        for seq in seqs:
            seq.commit(len(chunk))


@pytest.mark.parametrize("rows", [7, compact.ROWWISE_ROWS])
@pytest.mark.parametrize("family", compact.ARCHITECTURES)
def test_a_passs_rows_equal_one_token_passes(family, rows):
    """What keeps greedy speculation equal to plain decoding: verifying k tokens at once gives each the logits
    that k one-token passes give (mistral and qwen2 also cross their sliding window here), up to the row-wise
    limit (a prediction's 63 drafts and the pending token: backend/limits.py MAX_PREDICTION_GAMMA)."""
    model = _quantised(family, **SMOLLM_ATTENTION)
    fast = compact.build(model)
    prompt, draft = random_ids(85, seed=4), random_ids(rows, seed=5)
    together, alone = _cache(model).new_sequence(), _cache(model).new_sequence()
    for seq in (together, alone):
        paged_forward(model, seq, prompt, fast=fast)
        seq.commit(len(prompt))
    batch = paged_forward(model, together, draft, logits_to_keep=len(draft), fast=fast)
    rows = []
    for token in draft:
        rows.append(paged_forward(model, alone, [token], fast=fast))
        alone.commit(1)
    assert torch.equal(batch, torch.cat(rows))


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3"])
def test_other_architectures_keep_transformers_forward(family):
    model = build_tiny(family)
    quantize_model(model, "int4-torch", torch.device("cpu"))
    with pytest.raises(compact.Unsupported):
        compact.build(model)


def test_joined_projections_share_the_layers_bytes():
    model = _quantised("llama", **JOINABLE)
    before = sum(
        m.packed.untyped_storage().nbytes()
        for m in quant_linear.quantized_layers(model)
        if isinstance(m, quant_linear.Int4Linear)
    )
    fast = compact.build(model)
    layer = fast.layers[0]
    assert layer.q.packed.untyped_storage().data_ptr() == layer.qkv.packed.untyped_storage().data_ptr()
    storages = {
        m.packed.untyped_storage().data_ptr(): m.packed.untyped_storage().nbytes()
        for m in quant_linear.quantized_layers(model)
        if isinstance(m, quant_linear.Int4Linear)
    }
    assert sum(storages.values()) == before  # the joined copies replaced the separate ones


@pytest.mark.parametrize("family", compact.ARCHITECTURES)
def test_a_tree_nodes_row_equals_plain_decoding_of_its_path(family):
    """The suffix drafter's trees through the compact forward: each node attends the prefix and its ancestors in
    path order, so its logits are exactly those of one-token passes along its own path (what keeps tree
    verification equal to plain decoding on the int4 default)."""
    model = _quantised(family, **SMOLLM_ATTENTION)
    fast = compact.build(model)
    prompt = random_ids(40, seed=6)
    pending, tokens = 7, random_ids(6, seed=7)
    parents = [-1, 0, -1, 2, 3, 0]  # two branches from the pending token, one forking again at depth 2
    tree_seq = _cache(model).new_sequence()
    paged_forward(model, tree_seq, prompt, fast=fast)
    tree_seq.commit(len(prompt))
    rows = paged_forward(
        model, tree_seq, [pending] + tokens, logits_to_keep=1 + len(tokens), fast=fast, parents=parents
    )
    for node in range(-1, len(tokens)):
        path = []
        at = node
        while at != -1:
            path.insert(0, tokens[at])
            at = parents[at]
        seq = _cache(model).new_sequence()
        paged_forward(model, seq, prompt, fast=fast)
        seq.commit(len(prompt))
        for token in [pending] + path:
            last = paged_forward(model, seq, [token], fast=fast)
            seq.commit(1)
        assert torch.equal(rows[node + 1], last[0]), f"node {node} (path {path})"
