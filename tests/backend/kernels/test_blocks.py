"""The GGUF block kernels (backend/kernels/blocks.py, csrc/qgemm*.cpp) against the ``gguf`` package's
de-quantisation, on random blocks written straight into each type's layout.

The kernels quantise each activation row to 8 bits per block (:func:`quantized_x` does the same in numpy) and
compute integer block sums exactly, so y must equal x_q · dequant(W)ᵀ up to float rounding (``TIGHT`` of the
absolute sum), and x · dequant(W)ᵀ within the activation rounding: half a step (max|x_block| / 254) per input.
Row independence, thread counts and the scalar / AVX2 paths are checked bit for bit (tests/.../test_blocks_rows.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from specchat.backend.kernels import blocks

QUANTISED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
FLOATS = ["F32", "F16", "BF16"]
TIGHT = 2e-6


@pytest.fixture(scope="session")
def kernels():
    try:
        blocks.load()
    except blocks.KernelsUnavailable as exc:
        pytest.skip(str(exc))
    return blocks


def weight(type_name: str, rows: int, cols: int, seed: int = 0):
    data = blocks.random_blocks(type_name, rows, cols, np.random.default_rng(seed))
    reference = dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, cols).astype(np.float32)
    return data, reference


def quantized_x(x: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(x as the kernels see it: codes × scale per block, float64; each block's scale d), for quantised types."""
    block = 256 if type_name.endswith("_K") else 32
    m, k = x.shape
    xb = x.reshape(m, k // block, block).astype(np.float32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(xb * inv, -127, 127))
    return (q * d.astype(np.float64)).reshape(m, k), np.broadcast_to(d, xb.shape).reshape(m, k)


def check_against_reference(y: np.ndarray, x: np.ndarray, reference: np.ndarray, type_name: str) -> None:
    w = reference.astype(np.float64)
    if type_name in FLOATS:
        exact = x.astype(np.float64) @ w.T
        scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
        np.testing.assert_array_less(np.abs(y - exact), TIGHT * scale + 1e-30)
        return
    xq, d = quantized_x(x, type_name)
    exact_q = xq @ w.T
    scale = np.abs(xq) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - exact_q), TIGHT * scale + 1e-30)
    # against the unquantised x: within half an activation step per input (plus the rounding above)
    bound = (d / 2) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - x.astype(np.float64) @ w.T), bound * (1 + 1e-4) + TIGHT * scale + 1e-30)


@pytest.mark.parametrize("type_name", QUANTISED + FLOATS)
def test_dequantize_equals_gguf(kernels, type_name):
    block = blocks.LAYOUT[type_name][0]
    rows, cols = 13, 3 * max(block, 32)
    data, reference = weight(type_name, rows, cols, seed=1)
    w = kernels.qweight(data, type_name, rows, cols)
    got = w.dequantize().numpy()
    assert got.view(np.uint32).tolist() == reference.view(np.uint32).tolist()  # bit for bit (NaN-free data)
    ids = torch.tensor([12, 0, 5, 5])
    assert torch.equal(w.rows_of(ids), torch.from_numpy(reference[[12, 0, 5, 5]]))
    assert w.ggml_type() == blocks.TYPES[type_name]
    assert w.nbytes() >= data.nbytes


SHAPES = [(1, 1), (7, 2), (9, 3), (31, 1), (264, 4)]  # (N outputs, K in blocks of the type)


@pytest.mark.parametrize("type_name", QUANTISED + FLOATS)
@pytest.mark.parametrize("n, k_blocks", SHAPES)
def test_matmul_matches_reference(kernels, type_name, n, k_blocks):
    block = max(blocks.LAYOUT[type_name][0], 32)
    k = block * k_blocks
    data, reference = weight(type_name, n, k, seed=n + k)
    w = kernels.qweight(data, type_name, n, k)
    rng = np.random.default_rng(7)
    for m in (1, 3, 4, 5, 17, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, :: max(1, k // 5)] *= 8  # outliers: blocks with a large max and small other values
        y = w.matmul(torch.from_numpy(x)).numpy()
        assert y.shape == (m, n)
        check_against_reference(y.astype(np.float64), x, reference, type_name)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q6_K", "BF16"])
def test_prefill_chunk_of_512_rows(kernels, type_name):
    n, k = 40, 512
    data, reference = weight(type_name, n, k, seed=3)
    w = kernels.qweight(data, type_name, n, k)
    x = np.random.default_rng(4).standard_normal((512, k)).astype(np.float32)
    check_against_reference(w.matmul(torch.from_numpy(x)).numpy().astype(np.float64), x, reference, type_name)


def test_zero_rows_and_zero_blocks(kernels):
    data, _ = weight("Q4_0", 9, 64)
    w = kernels.qweight(data, "Q4_0", 9, 64)
    assert w.matmul(torch.zeros(0, 64)).shape == (0, 9)
    assert torch.equal(w.matmul(torch.zeros(2, 64)), torch.zeros(2, 9))  # all-zero rows: scale 0, no NaN


def test_bad_inputs_name_the_problem(kernels):
    data, _ = weight("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="holds 143 bytes, the shape needs 144"):
        kernels.qweight(data.reshape(-1)[:-1], "Q4_0", 4, 64)
    with pytest.raises(ValueError, match="multiple of the type's block of 32"):
        kernels.qweight(data, "Q4_0", 4, 48)
    with pytest.raises(ValueError, match="not supported"):
        kernels.qweight(data, "Q3_K", 4, 64)
    with pytest.raises(ValueError, match="not supported"):
        torch.classes.specchat.QWeight(torch.from_numpy(data).reshape(-1), 10, 4, 64)
    w = kernels.qweight(data, "Q4_0", 4, 64)
    with pytest.raises(ValueError, match="x has 32 columns, the weight 64 inputs"):
        w.matmul(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="2-D float32"):
        w.matmul(torch.zeros(1, 64, dtype=torch.float64))
    with pytest.raises(IndexError, match="id 4 is outside"):
        w.rows_of(torch.tensor([4]))


def test_isa_is_named(kernels):
    assert kernels.kernel_isa() in ("avx512-vnni", "avx512", "avx2", "scalar")
