"""Int4 / int8 linear layers (backend/kernels/quant_linear.py, int4_layout.py) against a de-quantised reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specchat.backend.kernels import int4_layout, quant_linear
from specchat.backend.kernels.quant_linear import (
    DEQUANT_ROWS,
    GROUP_SIZES,
    Int4Linear,
    Int8Linear,
    Q8Embedding,
    kernel_call,
    quantize_int4,
    quantize_int8_rows,
)


@pytest.fixture(autouse=True)
def dequantised_prefill(monkeypatch):
    """The de-quantised path for inputs over DEQUANT_ROWS rows on every machine (the CPU decides it in use)."""
    monkeypatch.setattr(quant_linear, "DEQUANTISE_PREFILL", True)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernels compute: the input rounded to bfloat16, then a float32 product."""
    return F.linear(x.to(torch.bfloat16).float(), weight, bias)


def test_layout_reproduces_pytorchs_packing_and_unpacks():
    # 128 rows: whole blocks of both layouts (32 rows with AVX2, 64 with AVX-512)
    codes = torch.randint(0, 16, (128, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    reference = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    assert torch.equal(int4_layout.pack_cpu(codes).view(torch.uint8), reference.view(torch.uint8))
    for rows in (32, 64, 96):  # one block of either layout too: packed contiguous, as the kernel needs
        assert int4_layout.pack_cpu(codes[:rows]).is_contiguous()
    if int4_layout.cpu_block_n() is None:
        pytest.skip("this CPU's int4 layout is not reproduced here: the op packs, nothing unpacks")
    assert torch.equal(int4_layout.unpack_cpu(int4_layout.pack_cpu(codes), 128), codes)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("rows", [1, 3, 8, DEQUANT_ROWS + 3])
def test_int4_matches_its_dequantised_weight(group_size, rows):
    g = torch.Generator().manual_seed(group_size + rows)
    n, k = 64, 512
    weight = torch.randn(n, k, generator=g)
    codes, scale, zero = quantize_int4(weight, group_size)
    bias = torch.randn(n, generator=g)
    exact = Int4Linear.from_codes(codes, scale, zero, group_size=group_size, bias=bias, compute_dtype=torch.float32)
    fast = Int4Linear.from_codes(codes, scale, zero, group_size=group_size, bias=bias)
    dq = (codes.view(n, k // group_size, group_size).float() - 8) * scale[..., None] + zero[..., None]
    dq = dq.view(n, k)
    assert (dq - weight).abs().max() <= scale.max() / 2 + 1e-5  # round-to-nearest: half a step
    x = torch.randn(rows, k, generator=g)
    torch.testing.assert_close(exact(x), F.linear(x, dq, bias), rtol=1e-4, atol=1e-3)
    # bfloat16 scales: each weight moves by at most 2^-9 of its group's |scale·(q-8)| + |zero|
    scale_b, zero_b = scale.bfloat16().float(), zero.bfloat16().float()
    dq_b = (codes.view(n, k // group_size, group_size).float() - 8) * scale_b[..., None] + zero_b[..., None]
    bound = ((codes.view(n, -1, group_size).float() - 8).abs() * scale[..., None] + zero.abs()[..., None]) * 2**-8
    assert ((dq_b - dq.view_as(dq_b)).abs() <= bound).all()
    out = fast(x)
    assert out.dtype == x.dtype
    ref = _reference(x, dq_b.view(n, k), bias)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    if int4_layout.cpu_block_n() is not None:
        assert torch.equal(fast.dequantized(), dq_b.view(n, k))


def test_int4_rejects_a_group_size_the_kernel_lacks():
    codes, scale, zero = quantize_int4(torch.randn(32, 48), 16)
    with pytest.raises(ValueError, match="group size"):
        Int4Linear.from_codes(codes, scale, zero, group_size=16)


@pytest.mark.parametrize("rows", [1, 5, DEQUANT_ROWS + 1])
def test_int8_matches_its_dequantised_weight(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=g)
    layer = Int8Linear.from_weight(weight)
    codes, scales = quantize_int8_rows(weight)
    assert (codes.float() * scales[:, None] - weight).abs().max() <= scales.max() / 2 + 1e-6
    x = torch.randn(rows, 160, generator=g)
    ref = _reference(x, layer.dequantized())
    torch.testing.assert_close(layer(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_rows_do_not_depend_on_how_many_there_are(group_size):
    """A verification pass over γ+1 rows gives each row exactly what a one-row pass gives it."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(192, 512, generator=g)
    int4 = Int4Linear.from_codes(*quantize_int4(weight, group_size), group_size=group_size)
    int8 = Int8Linear.from_weight(weight)
    for layer in (int4, int8):
        for rows in (2, 5, 9, 17, 32):
            x = torch.randn(rows, 512, generator=g)
            one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
            assert torch.equal(layer(x), one_by_one)


@pytest.mark.parametrize("bias", [False, True])
def test_a_bound_kernel_call_is_the_layers_matmul_bit_for_bit(bias):
    """The compact forward calls each projection through kernel_call: the same op on the same tensors, for a
    decoding row, a verification pass and a prefill long enough to take the de-quantised path."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(128, 256, generator=g)
    b = torch.randn(128, generator=g) if bias else None
    int4 = Int4Linear.from_codes(*quantize_int4(weight, 64), group_size=64, bias=b)
    int8 = Int8Linear.from_weight(weight, bias=b)
    for layer in (int4, int8):
        call = kernel_call(layer)
        for rows in (1, 8, DEQUANT_ROWS + 1):
            x = torch.randn(rows, 256, generator=g)
            assert torch.equal(call(x), layer.matmul(x))
            assert call(x).dtype == layer.compute_dtype
    plain = torch.nn.Linear(256, 128)
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(kernel_call(plain)(x), plain(x))


def test_q8_embedding_is_exact():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (50, 64), dtype=torch.int8, generator=g)
    scales = torch.rand(50, 2, generator=g)
    emb = Q8Embedding(codes, scales)
    ids = torch.tensor([[0, 7, 49]])
    expected = (codes.view(50, 2, 32).float() * scales[..., None]).view(50, 64)
    assert torch.equal(emb(ids)[0], expected[ids[0]])
    assert torch.equal(emb.dequantized(), expected)
    assert torch.equal(emb.dequantized(7, 20), expected[7:20])


@pytest.mark.parametrize("chunk", [1, 7, 64, 1024])
def test_int8_made_a_chunk_of_rows_at_a_time_equals_made_whole(chunk):
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (50, 64), dtype=torch.int8, generator=g)
    emb = Q8Embedding(codes, torch.rand(50, 2, generator=g))
    whole = Int8Linear.from_weight(emb.dequantized())
    chunked = Int8Linear.from_rows(emb.dequantized, (50, 64), chunk=chunk)
    assert torch.equal(chunked.weight, whole.weight) and torch.equal(chunked.scales, whole.scales)


@pytest.mark.cuda
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_int4_and_int8_on_cuda_match_their_dequantised_weight(group_size):
    """The tinygemm int4 kernel (as gpt-fast uses it) and the int8 kernel on CUDA (packaging/device_check.sh)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(group_size)
    weight = torch.randn(256, 512, generator=g)
    codes, scale, zero = quantize_int4(weight, group_size)
    layer = Int4Linear.from_codes(codes, scale, zero, group_size=group_size, device="cuda")
    dq = (
        (codes.view(256, -1, group_size).float() - 8) * scale.bfloat16().float()[..., None]
        + zero.bfloat16().float()[..., None]
    ).view(256, 512)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 512, generator=g)
        ref = _reference(x, dq)
        torch.testing.assert_close(layer(x.cuda()).cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    int8 = Int8Linear.from_weight(weight, device="cuda")
    x = torch.randn(3, 512, generator=g)
    ref = _reference(x, int8.dequantized().cpu())
    torch.testing.assert_close(int8(x.cuda()).cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
