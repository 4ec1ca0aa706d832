"""The CPU weight kernels that compute straight on GGUF blocks (``csrc/qgemm*.cpp``, issue 31), from Python.

What it gives: :func:`qweight` wraps a tensor's GGUF bytes as ``torch.classes.specchat.QWeight`` (its
``matmul(x [M, K] float32) -> [M, N]``, ``dequantize()``, ``rows_of(ids)``, ``nbytes()``, ``ggml_type()``);
:func:`kernel_isa` names the path the kernels take on this CPU ("avx512-vnni", "avx512", "avx2", "scalar";
``SPECCHAT_KERNELS=scalar|avx2|avx512`` sets one path for every call), :func:`isa_for_rows` the path a call of m
rows takes (on an AVX-512 CPU, AVX2 for up to four); :func:`random_blocks` writes random codes and small finite
scales straight into a type's block layout (tests, ``specchat bench --kernels``).

How it is built: the kernels are part of the one native library (``csrc/*.cpp``), built, cached and checked by
``native_build.py`` through ``native.ensure`` (the same build the CPU native model runs on); :func:`load` makes
it usable in this process or raises :class:`KernelsUnavailable` with the reason that build gives.

Types: ``TYPES`` maps each supported GGUF type name to its ggml id (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K). Weight shapes are ``[rows = N outputs, cols = K inputs]``; ``cols`` must be a multiple of
the type's block (1, 32 or 256 inputs).
"""

from __future__ import annotations

import numpy as np
import torch

from specchat.backend.kernels import native

TYPES: dict[str, int] = {
    "F32": 0,
    "F16": 1,
    "BF16": 30,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}
# (inputs per block, bytes per block, byte offsets of the block's fp16 scale fields)
LAYOUT: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "F32": (1, 4, ()),
    "F16": (1, 2, ()),
    "BF16": (1, 2, ()),
    "Q4_0": (32, 18, (0,)),
    "Q4_1": (32, 20, (0, 2)),
    "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)),
    "Q8_0": (32, 34, (0,)),
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
}


class KernelsUnavailable(RuntimeError):
    """The kernels could not be built or loaded on this machine (the message says why and what to do)."""


def load() -> None:
    """Make the native library (the kernels among it) usable in this process, building it the first time on this
    machine. Raises :class:`KernelsUnavailable` naming the reason (switched off, no compiler, a failed build)."""
    why = native.ensure()
    if why is not None:
        raise KernelsUnavailable(f"the GGUF block kernels are not available: {why}")


def qweight(data: np.ndarray | torch.Tensor, type_name: str, rows: int, cols: int) -> torch.ScriptObject:
    """A ``QWeight`` over ``data`` (the tensor's GGUF bytes, uint8, any shape); the bytes are copied (repacked)
    once, so ``data`` may be dropped afterwards. ValueError naming the field for an unknown type or a size that
    does not fit the shape."""
    if type_name not in TYPES:
        raise ValueError(f"GGUF type {type_name!r} is not supported by the block kernels (one of {', '.join(TYPES)})")
    load()
    tensor = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    made: torch.ScriptObject = torch.classes.specchat.QWeight(
        tensor.reshape(-1).view(torch.uint8), TYPES[type_name], rows, cols
    )
    return made


def kernel_isa() -> str:
    """The path the kernels take on this CPU, as named in the start line."""
    load()
    return str(torch.ops.specchat.kernel_isa())


def isa_for_rows(m: int) -> str:
    """The path a call of ``m`` activation rows takes now (see :func:`set_isa`)."""
    load()
    return str(torch.ops.specchat.kernel_isa_for_rows(m))


def set_isa(name: str) -> str:
    """Switch the kernels' path ("scalar", "avx2", "avx512"; clamped to what the CPU has) for every call, or back
    to the CPU's own choice ("auto": AVX-512 where present, with calls of up to four rows on AVX2); returns the path
    now taken. For tests and benchmarks: the environment variable SPECCHAT_KERNELS chooses it for a whole run."""
    load()
    return str(torch.ops.specchat.kernel_set_isa(name))


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Random weights of ``type_name`` as GGUF bytes ``[rows, cols / block * block_bytes]`` (uint8): random codes
    (every bit pattern, the K-quants' 6-bit scales included) with each fp16 scale field a finite value of
    magnitude in [scale/4, scale]; float types hold values of that magnitude."""
    blk, size, halves = LAYOUT[type_name]
    if cols % blk:
        raise ValueError(f"{type_name}: cols {cols} is not a multiple of its block of {blk}")
    n = rows * (cols // blk)
    if type_name in ("F32", "F16", "BF16"):
        values = (rng.uniform(scale / 4, scale, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
        stored: np.ndarray
        if type_name == "F32":
            stored = values.view(np.uint8)
        elif type_name == "F16":
            stored = values.astype(np.float16).view(np.uint8)
        else:
            stored = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return stored.reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for offset in halves:
        d = (rng.uniform(scale / 4, scale, n) * rng.choice([-1.0, 1.0], n)).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)
