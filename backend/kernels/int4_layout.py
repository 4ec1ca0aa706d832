"""The packed layouts of PyTorch's int4 weight kernels, so 4-bit codes are packed (and unpacked) without int32.

PyTorch's ``_convert_weight_to_int4pack_for_cpu(codes int32 [N, K], inner_k_tiles)`` packs 4-bit codes into
a layout that depends on the CPU (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``): rows in blocks of
``BLOCK_N`` (32 with AVX2, 64 with AVX-512), each block stored K-major; with AVX2 byte ``d`` of a block's
column ``k`` holds row ``d`` in its low nibble and row ``d + 16`` in its high one, with AVX-512 lanes 0|2 and
1|3 of 16 rows each are paired the same way. The op needs an int32 copy of every code (4x the weights in
transient memory) and packs element by element; doing the same permutation with a few uint8 tensor ops is
much faster, and its inverse lets a long prefill de-quantise a layer from the packed bytes alone.

Contract: :func:`cpu_block_n` packs a probe with PyTorch's op once per process and returns the block size
whose layout this module reproduces bit for bit (32 or 64), or None when neither matches (another CPU
family or a future PyTorch): then :func:`pack_cpu` uses the op and :func:`unpack_cpu` returns None, and
callers run the kernel itself. A tensor whose row count is not a multiple of the block is always packed by
the op (its last block has a different layout) and cannot be unpacked here.

On CUDA the tinygemm kernel takes ``_convert_weight_to_int4pack(uint8 [N, K/2], inner_k_tiles)``, whose
input holds two codes a byte, even column in the high nibble (:func:`pack_cuda`).
"""

from __future__ import annotations

import functools

import torch

_PROBE_N, _PROBE_K = 128, 64
INNER_K_TILES_CPU = 2  # the CPU op accepts 2, 4 or 8 and ignores it (its layout has no K tiling)


def _op_pack(codes: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), INNER_K_TILES_CPU)
    return packed


def _pack_blocks(codes: torch.Tensor, block_n: int) -> torch.Tensor:
    """``codes`` uint8 [N, K] (N a multiple of ``block_n``) in the layout of ``block_n`` (see the docstring)."""
    n, k = codes.shape
    lanes = codes.view(n // block_n, block_n // 16, 16, k)  # [blocks, lanes of 16 rows, 16, K]
    half = block_n // 32
    low, high = lanes[:, :half], lanes[:, half:]  # AVX2: lane 0 | lane 1; AVX-512: lanes 0,1 | lanes 2,3
    packed = (high << 4) | low  # [blocks, half, 16, K]
    # contiguous(): for a single block reshape returns a strided view (no copy), which the kernel refuses
    return packed.permute(0, 3, 1, 2).reshape(n, k // 2).contiguous()


def _unpack_blocks(packed: torch.Tensor, block_n: int, k: int) -> torch.Tensor:
    n = packed.shape[0]
    half = block_n // 32
    blocks = packed.view(n // block_n, k, half, 16).permute(0, 2, 3, 1)  # [blocks, half, 16, K]
    return torch.cat([blocks & 15, blocks >> 4], dim=1).reshape(n, k)


@functools.cache
def cpu_block_n() -> int | None:
    """The row block of this CPU's int4 layout when this module reproduces it exactly, else None."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (_PROBE_N, _PROBE_K), dtype=torch.uint8, generator=generator)
    try:
        reference = _op_pack(codes)
    except (RuntimeError, NotImplementedError):
        return None
    for block_n in (32, 64):
        mine = _pack_blocks(codes, block_n)
        if mine.shape == reference.shape and torch.equal(mine, reference.view(torch.uint8)):
            if torch.equal(_unpack_blocks(mine, block_n, _PROBE_K), codes):
                return block_n
    return None


def pack_cpu(codes: torch.Tensor) -> torch.Tensor:
    """4-bit ``codes`` (uint8 [N, K], values 0..15) in the layout ``_weight_int4pack_mm_for_cpu`` reads."""
    block_n = cpu_block_n()
    if block_n is not None and codes.shape[0] % block_n == 0:
        return _pack_blocks(codes.to(torch.uint8).contiguous(), block_n)
    return _op_pack(codes)


def unpack_cpu(packed: torch.Tensor, in_features: int) -> torch.Tensor | None:
    """The uint8 codes [N, K] of a tensor :func:`pack_cpu` made, or None when the layout is not known here."""
    block_n = cpu_block_n()
    if block_n is None or packed.shape[0] % block_n:
        return None
    return _unpack_blocks(packed, block_n, in_features)


def inner_k_tiles(in_features: int) -> int:
    """The largest tiling (8, 4 or 2) the CUDA layout allows for ``in_features`` (a multiple of 16·tiles)."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"in_features {in_features} is not a multiple of 32, as the CUDA int4 kernel needs")


def pack_cuda(codes: torch.Tensor) -> torch.Tensor:
    """4-bit ``codes`` (uint8 [N, K] on a CUDA device) in the layout ``_weight_int4pack_mm`` reads there."""
    pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles(codes.shape[1]))
    return packed
