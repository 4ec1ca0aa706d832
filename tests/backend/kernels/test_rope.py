"""backend/kernels/rope.py against transformers' ROPE_INIT_FUNCTIONS and rotary embeddings: the same frequencies
and cos/sin, bit for bit, for each rope type the native model runs; the others are refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specchat.backend.kernels.rope import RopeUnsupported, cos_sin_tables, rope_frequencies

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16},
}  # fmt: skip


def _config(params, **extra):
    return AutoConfig.for_model(
        "llama", hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
        rope_parameters={"rope_theta": 50000.0, **params}, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_equal_transformers(name):
    config = _config(SCALINGS[name])
    expected, scaling = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](config, "cpu")
    got, got_scaling, dim = rope_frequencies(config.rope_parameters, 32, 256)
    assert torch.equal(got, expected) and got_scaling == scaling and dim == 32


def test_default_and_tables_equal_transformers_rotary():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config({"rope_type": "default"})
    rotary = LlamaRotaryEmbedding(config)
    inv_freq, scaling, _ = rope_frequencies(config.rope_parameters, 32, 256)
    assert torch.equal(inv_freq, rotary.inv_freq)
    cos, sin = cos_sin_tables(inv_freq, scaling, 300)
    positions = torch.tensor([[0, 1, 7, 299]])
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cos[positions[0]], want_cos[0, :, :16]) and torch.equal(sin[positions[0]], want_sin[0, :, :16])


def test_partial_rotation():
    inv_freq, _, dim = rope_frequencies(
        {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, 32, 0
    )
    assert dim == 16 and inv_freq.numel() == 8


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_types_are_refused(kind):
    with pytest.raises(RopeUnsupported, match=kind):
        rope_frequencies({"rope_type": kind, "factor": 2.0}, 32, 256)
