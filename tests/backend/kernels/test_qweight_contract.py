"""The weight kernels' contract as the native model uses it (csrc/qgemm.h: torch.classes.specchat.QWeight): every
block type de-quantises as the gguf package does, on random blocks written straight into the block layout; a
matmul over 1..64 rows equals x · Wᵀ to float rounding and gives each row what a one-row matmul gives it, bit for
bit. Whatever implements qgemm.h (qgemm*.cpp) must pass these."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from native_fixtures import native_ready  # noqa: F401  (a fixture)

from specchat.backend.kernels.native_model import GGML_TYPES, qweight

# Byte offsets of each block type's float16 fields (scales, minimums), which random bytes must not make NaN.
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of random codes with small finite scales."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[name]
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    if name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if name == "F32":
            return values.view(np.uint8)
        if name == "F16":
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    for at in HALF_FIELDS[name]:
        scales = (rng.random((rows, cols // per_block)) * 0.02 + 0.001).astype(np.float16)
        blocks[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // per_block, 2)
    return blocks.reshape(rows, -1)


def _case(name: str) -> tuple[int, int]:
    per_block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]
    return 37, per_block * (3 if per_block > 1 else 96)


@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_dequantize_matches_gguf(name, native_ready):  # noqa: F811
    rows, cols = _case(name)
    raw = random_blocks(name, rows, cols, seed=len(name))
    weight = qweight(torch.from_numpy(raw.copy()), GGML_TYPES[name], rows, cols)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, cols)
    got = weight.dequantize()
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(weight.rows_of(ids), got[ids])


@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_matmul_rows_are_independent(name, native_ready):  # noqa: F811
    rows, cols = _case(name)
    raw = random_blocks(name, rows, cols, seed=7)
    weight = qweight(torch.from_numpy(raw.copy()), GGML_TYPES[name], rows, cols)
    dense = weight.dequantize().double()
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(1))
    together = weight.matmul(x)
    reference = (x.double() @ dense.T).float()
    scale = float(reference.abs().max()) + 1e-6
    # quantised types take 8-bit activations (qgemm.h): within a percent of the float product, not to rounding
    tolerance = 1e-4 if name in ("F32", "F16", "BF16") else 2e-2
    assert float((together - reference).abs().max()) <= tolerance * scale
    for m in (1, 4, 16):
        assert torch.equal(weight.matmul(x[:m]), together[:m])
    assert torch.equal(weight.matmul(x[63:64]), together[63:64])


def test_a_wrong_size_is_refused(native_ready):  # noqa: F811
    with pytest.raises(ValueError, match="bytes"):
        qweight(torch.zeros(17, dtype=torch.uint8), GGML_TYPES["Q4_0"], 1, 32)
    with pytest.raises(ValueError, match="multiple of the type's block"):
        qweight(torch.zeros(18, dtype=torch.uint8), GGML_TYPES["Q4_0"], 1, 31)
