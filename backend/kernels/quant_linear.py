"""Weight-only quantised linear layers through PyTorch's own kernels: groupwise int4 and per-row int8.

Why: decoding reads every weight once per token, so bytes per weight bound the speed (float32: 4 bytes,
these: ~0.6 and ~1). No native dependency: the kernels are ATen's.

- :class:`Int4Linear`: 4-bit codes ``q`` in 0..15 with a scale and a zero per group of ``group_size`` input
  features, ``w = (q - 8)·scale + zero`` (the tinygemm convention). Kernels: ``_weight_int4pack_mm_for_cpu``
  on CPU (packed for this CPU at load time, ``int4_layout.py``), ``_weight_int4pack_mm`` (tinygemm) on CUDA.
  Group sizes 32, 64, 128, 256.
- :class:`Int8Linear`: int8 codes with one scale per output row, ``w = q·scale``, through
  ``_weight_int8pack_mm``.
- :class:`Q8Embedding`: an input embedding kept as int8 codes with a float32 scale per 32 values (GGUF Q8_0),
  de-quantised row by row on lookup (exactly ``d·q``).

Activations: the CPU kernels vectorise (AVX2 / AVX-512) only for bfloat16 inputs and scales; with float32 they
run a scalar loop. So inputs are rounded to ``compute_dtype`` (bfloat16 on CPU and CUDA), the kernel's output
is in it, and the layer returns it in the input's dtype: a model keeps its residual stream, norms, rotary
embedding and attention in float32 around these layers (``backend/models/loading/quantized.py``). Every row of an
input is computed the same way whatever the row count, so a verification pass over γ+1 tokens gives each
token the result a one-token pass gives it (greedy speculative decoding stays equal to plain decoding;
``tests/backend/kernels/test_quant_linear.py`` checks this).

Prefill: these kernels widen the 4-bit weights again for every block of 4 input rows. With AVX2 only, that
makes a pass over hundreds of rows cost several times a float32 GEMM, so there (:data:`DEQUANTISE_PREFILL`) a
pass over more than :data:`DEQUANT_ROWS` rows (only a long prompt's prefill: a verification pass has at most
32) de-quantises the weight to float32 (one layer at a time, from the packed bytes) and runs ``F.linear``; the
result is rounded to ``compute_dtype`` like the kernel's. With AVX-512 the kernel stays the faster one
(``benchmarks/RESULTS.md``, "Prefill and weights"). The choice follows the CPU, never a timing, so a prompt's
prefill is the same computation on every run of a machine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specchat.backend.kernels import int4_layout

GROUP_SIZES = (32, 64, 128, 256)
DEQUANT_ROWS = 160  # where de-quantising a layer once starts to beat the kernel with AVX2 (benchmarks/RESULTS.md)
# Whether long prefills de-quantise at all: not where ATen's CPU kernels run their AVX-512 versions.
DEQUANTISE_PREFILL = torch.backends.cpu.get_cpu_capability() != "AVX512"


def _dequantises(rows: int) -> bool:
    """Whether a CPU pass over ``rows`` input rows de-quantises the weight instead of calling the kernel."""
    return DEQUANTISE_PREFILL and rows > DEQUANT_ROWS


def _flat(x: torch.Tensor, in_features: int) -> torch.Tensor:
    return x.reshape(-1, in_features)


class Int4Linear(nn.Module):
    """``y = x·Wᵀ (+ bias)`` with ``W`` groupwise int4 (see the module docstring). Build with :meth:`from_codes`."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [K / group, N, 2] in compute_dtype: (scale, zero) per group and output row

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if group_size not in GROUP_SIZES or in_features % group_size:
            raise ValueError(
                f"int4 layers need a group size in {GROUP_SIZES} dividing in_features ({in_features}), got {group_size}"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias.to(scales_zeros.dtype), requires_grad=False)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        *,
        group_size: int,
        bias: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> Int4Linear:
        """From ``codes`` uint8 [N, K] (0..15) and ``scale`` / ``zero`` [N, K / group] (``w = (q-8)·scale + zero``).
        ``compute_dtype`` float32 keeps the scales exact but runs the kernels' scalar loop (CPU)."""
        device = torch.device(device)
        out_features, in_features = codes.shape
        codes = codes.to(device=device, dtype=torch.uint8)
        packed = int4_layout.pack_cuda(codes) if device.type == "cuda" else int4_layout.pack_cpu(codes)
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(device=device, dtype=compute_dtype).contiguous()
        return cls(in_features, out_features, group_size, packed, scales_zeros, bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_zeros.dtype

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The weight [N, K] as ``dtype``, or None where the packed layout cannot be read back (see int4_layout)."""
        if self.packed.device.type != "cpu":
            return None
        codes = int4_layout.unpack_cpu(self.packed, self.in_features)
        if codes is None:
            return None
        groups = self.in_features // self.group_size
        scale = self.scales_zeros[..., 0].t().to(dtype).unsqueeze(-1)  # [N, groups, 1]
        zero = self.scales_zeros[..., 1].t().to(dtype).unsqueeze(-1)
        weight = codes.view(self.out_features, groups, self.group_size).to(dtype).sub_(8).mul_(scale).add_(zero)
        return weight.view(self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] (any float dtype, rounded to compute_dtype) times the weight, plus the bias: [M, N] in
        compute_dtype. What :meth:`forward` computes, without its reshapes and its cast back."""
        out: torch.Tensor  # (torch.ops are typed as returning Any)
        if _dequantises(x.shape[0]) and self.packed.device.type == "cpu":
            weight = self.dequantized()
            if weight is not None:
                out = F.linear(x.to(self.compute_dtype).float(), weight).to(self.compute_dtype)
                return out if self.bias is None else out + self.bias
        x = x.to(self.compute_dtype).contiguous()
        if self.packed.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(_flat(x, self.in_features))
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"compute_dtype={self.compute_dtype}, bias={self.bias is not None}"
        )


class Int8Linear(nn.Module):
    """``y = x·Wᵀ (+ bias)`` with ``W`` int8 and one scale per output row. Build with :meth:`from_weight`."""

    weight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N] in compute_dtype

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.to(scales.dtype), requires_grad=False)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> Int8Linear:
        """Quantise a float ``weight`` [N, K] symmetrically per row (``scale = max|w| / 127``)."""
        codes, scales = quantize_int8_rows(weight.float())
        return cls(codes.to(device), scales.to(device=device, dtype=compute_dtype), bias)

    @classmethod
    def from_rows(
        cls,
        rows: Callable[[int, int], torch.Tensor],
        shape: tuple[int, int],
        *,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.bfloat16,
        chunk: int = 1024,
    ) -> Int8Linear:
        """:meth:`from_weight` of the weight whose float rows ``a..b`` are ``rows(a, b)``, made a chunk of rows
        at a time: the same codes and scales (each row is quantised alone) without the whole float weight in
        memory at once (a large head's float copy costs both memory and time at a start: ``benchmarks/RESULTS.md``,
        "Figures moved out of the code")."""
        out_features, in_features = shape
        codes = torch.empty(out_features, in_features, dtype=torch.int8)
        scales = torch.empty(out_features, dtype=torch.float32)
        for a in range(0, out_features, chunk):
            b = min(a + chunk, out_features)
            codes[a:b], scales[a:b] = quantize_int8_rows(rows(a, b).float())
        return cls(codes.to(device), scales.to(device=device, dtype=compute_dtype))

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype) * self.scales.to(dtype).unsqueeze(-1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] times the weight, plus the bias: [M, N] in compute_dtype (see :meth:`Int4Linear.matmul`)."""
        if _dequantises(x.shape[0]) and self.weight.device.type == "cpu":
            out = F.linear(x.to(self.compute_dtype).float(), self.dequantized()).to(self.compute_dtype)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x.to(self.compute_dtype).contiguous(), self.weight, self.scales)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(_flat(x, self.in_features))
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compute_dtype={self.compute_dtype}"


class Q8Embedding(nn.Module):
    """An embedding table of int8 codes and one float32 scale per ``group`` values: row ``i`` is ``d·q``."""

    codes: torch.Tensor  # int8 [V, H]
    scales: torch.Tensor  # float32 [V, H / group]

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.group = self.embedding_dim // scales.shape[1]
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales.float())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes, scales = self.codes[ids], self.scales[ids]
        rows = codes.view(*ids.shape, -1, self.group).float() * scales.unsqueeze(-1)
        return rows.view(*ids.shape, self.embedding_dim)

    def dequantized(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``first .. end-1`` (all by default) as float32."""
        codes, scales = self.codes[first:end], self.scales[first:end]
        return (codes.view(codes.shape[0], -1, self.group).float() * scales.unsqueeze(-1)).view(
            codes.shape[0], self.embedding_dim
        )


def kernel_call(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function computing ``layer.matmul(x)`` (``layer(x)`` for any other module) for 2-D ``x``, with what it
    reads per call (the packed weight, scales, bias, the op) looked up once here instead of on every call. The
    compact forward (``compact.py``) makes ~120 such calls a token, where those lookups add up to a visible share
    of it (``benchmarks/RESULTS.md``, "Figures moved out of the code").
    Same op on the same tensors: the result is the method's, bit for bit. Bind it after the layer's buffers
    are final (``compact._join`` re-points them)."""
    if isinstance(layer, Int4Linear) and layer.packed.device.type == "cpu":
        op4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default
        packed, group, scales_zeros = layer.packed, layer.group_size, layer.scales_zeros
        return _bound(layer, lambda x: op4(x, packed, group, scales_zeros))
    if isinstance(layer, Int8Linear) and layer.weight.device.type == "cpu":
        op8 = torch.ops.aten._weight_int8pack_mm.default
        weight, scales = layer.weight, layer.scales
        return _bound(layer, lambda x: op8(x, weight, scales))
    matmul = getattr(layer, "matmul", None)
    return matmul if matmul is not None else layer


def _bound(
    layer: Int4Linear | Int8Linear, kernel: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    dtype, bias, long_input = layer.compute_dtype, layer.bias, layer.matmul

    def call(x: torch.Tensor) -> torch.Tensor:
        if _dequantises(x.shape[0]):
            return long_input(x)
        out = kernel(x.to(dtype).contiguous())
        return out if bias is None else out + bias

    return call


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 of a float ``weight`` [N, K] per group: ``(codes uint8, scale, zero)`` with
    ``w ≈ (q - 8)·scale + zero`` (scale, zero float32 [N, K / group])."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    return codes.view(n, k), scale, low + 8 * scale


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``(codes int8 [N, K], scales float32 [N])`` with ``w ≈ q·scale``."""
    scales = (weight.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (weight / scales.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scales


def quantized_layers(model: nn.Module) -> list[nn.Module]:
    """The :class:`Int4Linear` / :class:`Int8Linear` layers of ``model``."""
    return [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
