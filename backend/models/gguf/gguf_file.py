"""Reading a GGUF file's metadata and tensors without llama.cpp: what the int4/int8 loader needs, fast.

Contract:

- :func:`read_gguf(path)` parses the header (version 2 or 3), every metadata value (long arrays of strings,
  the tokenizer's vocabulary and merges, are skipped unless asked for with ``keep_arrays``) and the tensor
  table, and returns a :class:`GgufFile` whose tensors are zero-copy views of one read-only memory map of the
  file. A truncated, garbage or unsupported file raises :class:`GgufFormatError` (a ``ValueError``) naming
  what is wrong; it never reads past the end.
- Tensor shapes are in torch order (``[out_features, in_features]`` for a weight); ``raw`` is the bytes of
  the tensor as stored, ``[rows, bytes per row]``.
- Block formats the int4/int8 path keeps as they are (``backend/models/loading/quantized.py``): :func:`q4_blocks`
  splits Q4_0 / Q4_1 rows (32 weights a block: fp16 scale ``d``, for Q4_1 an fp16 minimum ``m``, then 16
  bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31; ``w = d·q + m``, Q4_0
  ``w = d·(q - 8)``) into codes and scales; :func:`q8_0_blocks` splits Q8_0 rows (fp16 ``d``, 32 int8 codes,
  ``w = d·q``). Any other type is de-quantised by :func:`dequantize` (the ``gguf`` package's numpy code).
- ``llama``-architecture files store the rows of ``attn_q`` / ``attn_k`` permuted for llama.cpp's rotary
  layout; :func:`unpermute_rows` gives the row order transformers uses (the inverse of llama.cpp's
  ``convert_hf_to_gguf`` permutation, as transformers' own GGUF loader applies it). Rows move whole, so a
  block format is unpermuted by reordering its rows.

The file format is llama.cpp's ``docs/gguf.md``; only the standard library, numpy and torch are used here (torch
only by the functions that return tensors: reading a header, as ``models.yaml``'s checks do, imports no torch).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# ggml type ids of the formats handled here without the gguf package (values from ggml.h).
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", BF16: "BF16"}
# (weights, bytes) per block of the types above, as ggml defines them: the common files need no ``gguf`` import
# (its enums' import is a noticeable part of a start: benchmarks/RESULTS.md, "Figures moved out of the code"); other
# types ask the ``gguf`` package.
_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


class GgufFormatError(ValueError):
    """The file is not a GGUF this reader understands (truncated, garbage, unknown version or type)."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order: [rows, columns] for a matrix
    raw: np.ndarray  # uint8 [rows, bytes per row], a view of the file's memory map

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.ggml_type) or _gguf_type_name(self.ggml_type)


@dataclass
class GgufFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        """``<architecture>.<key>`` (e.g. ``block_count``), else ``default``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def _gguf_type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _block_size(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type."""
    known = _BLOCKS.get(ggml_type)
    if known is not None:
        return known
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GgufFormatError(f"unknown ggml tensor type {ggml_type}") from None


_LENGTH = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.pos = buffer, 0

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if size < 0 or end > len(self.buffer):
            raise GgufFormatError(f"the file ends early (needs {end} bytes, has {len(self.buffer)}): truncated?")
        view = self.buffer[self.pos : end]
        self.pos = end
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.scalar("<Q")
        return bytes(self.take(size)).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        # A tokenizer's vocabulary and merges are ~100,000 strings: one unpack_from per length, no views.
        buffer, pos, end, unpack = self.buffer, self.pos, len(self.buffer), _LENGTH.unpack_from
        for _ in range(count):
            if pos + 8 > end:  # also where a length ran past the end of the file
                raise GgufFormatError(f"the file ends early (needs {pos + 8} bytes, has {end}): truncated?")
            pos += 8 + unpack(buffer, pos)[0]
        if pos > end:
            raise GgufFormatError(f"the file ends early (needs {pos} bytes, has {end}): truncated?")
        self.pos = pos

    def value(self, kind: int, keep_array: bool) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GgufFormatError(f"unknown metadata value type {kind}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in _NUMPY:
            width = np.dtype(_NUMPY[item]).itemsize
            data = self.take(count * width)
            return np.frombuffer(data, dtype=_NUMPY[item]).tolist() if keep_array else _Skipped(count)
        if item == _STRING:
            if keep_array:
                return [self.string() for _ in range(count)]
            self.skip_strings(count)
            return _Skipped(count)
        return [self.value(item, keep_array) for _ in range(count)]


@dataclass(frozen=True)
class _Skipped:
    """An array left unread (its length only): the tokenizer's lists when they are not needed."""

    count: int


def _map(path: Path) -> mmap.mmap:
    """The file, memory-mapped read-only (pages are read only where a parse looks)."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size < 24:
            raise GgufFormatError(f"{size} bytes is too short for a GGUF header")
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


def _header(cursor: _Cursor) -> tuple[int, int, int]:
    """The magic, checked, then ``(version, tensor count, metadata count)``, checked against the file's size."""
    size = len(cursor.buffer)
    if bytes(cursor.take(4)) != GGUF_MAGIC:
        raise GgufFormatError("the file does not start with 'GGUF' (not a GGUF file, or damaged)")
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise GgufFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
    if tensor_count > size // 24 or kv_count > size // 12:
        raise GgufFormatError(
            f"the header claims {tensor_count} tensors and {kv_count} metadata values in a {size}-byte file: damaged"
        )
    return version, tensor_count, kv_count


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """One entry of the tensor table: ``(name, shape in torch order, ggml type, offset)``."""
    name = cursor.string()
    dims = cursor.scalar("<I")
    if not 1 <= dims <= _MAX_DIMS:
        raise GgufFormatError(f"tensor {name!r} has {dims} dimensions")
    ne = [cursor.scalar("<Q") for _ in range(dims)]
    return name, tuple(reversed(ne)), cursor.scalar("<I"), cursor.scalar("<Q")


def read_gguf(path: str | Path, *, keep_arrays: tuple[str, ...] = ()) -> GgufFile:
    """Parse ``path`` (see the module docstring). Arrays whose key is in ``keep_arrays``, and every array of
    numbers shorter than 64 items, are read; other arrays are recorded as skipped."""
    path = Path(path)
    mapped = _map(path)
    size = len(mapped)
    cursor = _Cursor(memoryview(mapped))
    version, tensor_count, kv_count = _header(cursor)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        kind = cursor.scalar("<I")
        keep = key in keep_arrays
        if kind == _ARRAY and not keep:  # small numeric arrays are cheap and sometimes needed
            start = cursor.pos
            item, count = cursor.scalar("<I"), cursor.scalar("<Q")
            keep = item in _NUMPY and count < 64
            cursor.pos = start
        metadata[key] = cursor.value(kind, keep)
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT) or DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    whole = np.frombuffer(mapped, dtype=np.uint8)
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        per_block, block_bytes = _block_size(ggml_type)
        columns = shape[-1]
        if columns % per_block:
            raise GgufFormatError(
                f"tensor {name!r}: {columns} columns is not a whole number of {per_block}-weight blocks"
            )
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        row_bytes = columns // per_block * block_bytes
        start = data_start + offset
        if start + rows * row_bytes > size:
            raise GgufFormatError(
                f"tensor {name!r} ends at byte {start + rows * row_bytes} of a {size}-byte file: truncated"
            )
        raw = whole[start : start + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GgufTensor(name, ggml_type, shape, raw)
    return GgufFile(path=path, version=version, metadata=metadata, tensors=tensors)


@dataclass(frozen=True)
class ReaderField:
    """One metadata value as the ``gguf`` package's ``GGUFReader`` shows it to transformers: ``parts[i]`` for
    ``i`` in ``data`` are its values (the raw bytes of a string, a one-item list for a number), ``types`` its
    value type (``[9, item type]`` for an array)."""

    name: str
    parts: list[Any]
    data: list[int]
    types: list[int]


@dataclass(frozen=True)
class _TensorName:
    name: str


class MetadataReader:
    """The ``gguf`` package's ``GGUFReader`` as far as transformers' ``load_gguf_checkpoint(path,
    return_tensors=False)`` uses it: ``fields`` (every metadata value, :class:`ReaderField`) and ``tensors``
    (their names).

    Why: ``GGUFReader`` builds a numpy view for each element of every array (the tokenizer's 49,152 tokens and 48,900
    merges in the embedded file): most of a first start (``benchmarks/RESULTS.md``, "Start time and memory"). This
    reads the same bytes with ``struct`` and keeps them raw (bytes, not decoded), so transformers parses exactly what
    it parses from ``GGUFReader`` (``backend/models/gguf/convert.py`` swaps it in for that one call; a test compares
    the two)."""

    def __init__(self, path: str | Path) -> None:
        try:  # the map goes with its last reference: every value kept is a copy (bytes, Python numbers)
            self._parse(_Cursor(memoryview(_map(Path(path)))))
        except GgufFormatError as error:
            raise GgufFormatError(f"{path}: {error}") from None

    def _parse(self, cursor: _Cursor) -> None:
        version, tensor_count, kv_count = _header(cursor)
        self.fields: dict[str, ReaderField] = {  # GGUFReader's own entries for the header, first
            name: ReaderField(name, [[value]], [0], [kind])
            for name, value, kind in (
                ("GGUF.version", version, 4),
                ("GGUF.tensor_count", tensor_count, 10),
                ("GGUF.kv_count", kv_count, 10),
            )
        }
        for _ in range(kv_count):
            name = bytes(cursor.take(cursor.scalar("<Q"))).decode("utf-8")
            kind = cursor.scalar("<I")
            if kind == _ARRAY:
                item, count = cursor.scalar("<I"), cursor.scalar("<Q")
                parts = _raw_items(cursor, item, count)
                self.fields[name] = ReaderField(name, parts, list(range(len(parts))), [_ARRAY, item])
            else:
                self.fields[name] = ReaderField(name, _raw_items(cursor, kind, 1), [0], [kind])
        self.tensors = [_TensorName(_tensor_info(cursor)[0]) for _ in range(tensor_count)]


def _raw_items(cursor: _Cursor, kind: int, count: int) -> list[Any]:
    """``count`` values of type ``kind``: raw bytes for strings, one-item lists for numbers."""
    if kind == _STRING:
        out = []
        for _ in range(count):
            out.append(bytes(cursor.take(cursor.scalar("<Q"))))
        return out
    if kind in _NUMPY:
        width = np.dtype(_NUMPY[kind]).itemsize
        return [[v] for v in np.frombuffer(cursor.take(count * width), dtype=_NUMPY[kind]).tolist()]
    if kind == _ARRAY:
        raise GgufFormatError("nested metadata arrays are not supported")
    raise GgufFormatError(f"unknown metadata value type {kind}")


def _fp16_column(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 value stored at byte ``at`` of every block, as a float32 tensor ``[rows, blocks]``."""
    import torch

    return torch.from_numpy(np.array(blocks[..., at : at + 2]).view(np.float16)[..., 0]).float()


def q4_blocks(tensor: GgufTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 as ``(codes uint8 [N, K] in 0..15, d float32 [N, K/32], m float32 [N, K/32])`` with
    ``w = d·q + m`` exactly (Q4_0: ``m = -8·d``, exact in float32)."""
    import torch

    if tensor.ggml_type not in (Q4_0, Q4_1):
        raise GgufFormatError(f"tensor {tensor.name!r} is {tensor.type_name}, not Q4_0 or Q4_1")
    rows, width = tensor.shape[0], tensor.shape[-1]
    block = 20 if tensor.ggml_type == Q4_1 else 18
    blocks = tensor.raw.reshape(rows, width // 32, block)
    d = _fp16_column(blocks, 0)
    m = _fp16_column(blocks, 2) if tensor.ggml_type == Q4_1 else -8.0 * d
    packed = torch.from_numpy(np.array(blocks[..., block - 16 :]))  # [N, K/32, 16]
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(rows, width)
    return codes, d, m


def q8_0_blocks(tensor: GgufTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 as ``(codes int8 [N, K], d float32 [N, K/32])`` with ``w = d·q`` exactly."""
    import torch

    if tensor.ggml_type != Q8_0:
        raise GgufFormatError(f"tensor {tensor.name!r} is {tensor.type_name}, not Q8_0")
    rows, width = tensor.shape[0], tensor.shape[-1]
    blocks = tensor.raw.reshape(rows, width // 32, 34)
    d = _fp16_column(blocks, 0)
    codes = torch.from_numpy(np.array(blocks[..., 2:]).view(np.int8)).reshape(rows, width)
    return codes, d


def dequantize(tensor: GgufTensor) -> torch.Tensor:
    """Any tensor type as float32 in its torch shape (F32/F16/BF16 directly, block types via ``gguf``)."""
    import torch

    if tensor.ggml_type == F32:
        return torch.from_numpy(np.array(tensor.raw).view(np.float32)).reshape(tensor.shape)
    if tensor.ggml_type == F16:
        return torch.from_numpy(np.array(tensor.raw).view(np.float16)).float().reshape(tensor.shape)
    if tensor.ggml_type == BF16:
        words = torch.from_numpy(np.array(tensor.raw).view(np.int16))
        return words.view(torch.bfloat16).float().reshape(tensor.shape)
    import gguf

    values = gguf.quants.dequantize(tensor.raw, gguf.GGMLQuantizationType(tensor.ggml_type))
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(tensor.shape)


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's rotary permutation of an ``attn_q`` / ``attn_k`` weight with
    ``heads`` heads (``heads`` KV heads for ``attn_k``): ``weight[index]`` is transformers' row order."""
    import torch

    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
