"""How much memory a pair needs, and whether the device has it free, from models.yaml's numbers alone (offline).

Estimate (bytes), per model (target, and the draft when the drafter is draft-model):

- weights: ``params x bytes(dtype)`` (``params`` counted from the model's files: ``model_facts``); where the
  weights stay as the files store them (the CPU native model, :func:`as_stored`; and on CUDA with ``dtype: auto``
  for a checkpoint stored in 16 bits) the files' own bytes: the sum of the GGUF's tensor bytes per stored type
  (types without a kernel at F16, as the loader converts them: :func:`native_weight_bytes`), or the safetensors
  headers' dtypes x shapes;
  with ``nf4`` the linear layers take 0.5 byte per weight plus one float32
  absmax per 64-weight block, with ``int8`` 1 byte plus a float32 scale per output row; embeddings (and an
  untied output head) stay in the compute dtype, as bitsandbytes leaves them unquantised; ``int4-torch`` /
  ``int8-torch`` as :func:`_torch_quantized_bytes` says (activations and KV cache in bfloat16);
- KV cache: ``layers x 2 x kv_heads x head_dim x bytes x context_length`` (bytes: the compute dtype's; the native
  model's cache is float16 for a GGUF: :func:`kv_dtype_bytes`);
- scratch (the larger of the two models, which run one after the other): activations of one forward over
  :data:`specchat.backend.limits.PREFILL_CHUNK` tokens (``tokens x hidden x 16 x bytes``; MLP intermediate ~4 x hidden),
  attention scores if materialised (``heads x tokens x context x 4``: SDPA's math path with a mask), one
  layer's K/V gathered from the paged cache (``2 x kv_heads x head_dim x context x bytes``), and the logits
  rows a pass keeps: :data:`LOGIT_ROWS` (a verification at the largest γ; a prefill chunk keeps one row, the
  last) x vocab x (``bytes`` for the model's output + :data:`DECISION_BYTES` for the float32 copy and the
  penalised copy), plus the Gumbel noise and scores of ``backend/speculative/sampling.py``, drawn
  ``sampling.PICK_ROWS`` rows at a time (:data:`NOISE_BYTES` per logit of those rows);
  the native model's pass instead counts its own buffers (:func:`native_scratch_bytes`), which it keeps between
  passes, so a native target and draft add theirs;
- CUDA graphs (CUDA only, per model; ``backend/kernels/cuda_graphs.py``): the runner's static buffers
  (its shared float32 logits rows, :func:`~specchat.backend.kernels.cuda_graphs.static_bytes`) and the graphs'
  private memory pool, which eager passes cannot reuse: a forward over the largest token bucket (activations,
  attention scores, one layer's gathered K/V, its logits rows);
- headroom: 8 % of the sum;
- runtime (CPU only, not part of ``total``: the process holds it before any model loads, and free memory is
  what is left beside it): :data:`RUNTIME_BYTES` for Python, torch and specchat's modules, measured, plus the
  tokenizer at :data:`TOKENIZER_BYTES_PER_TOKEN` per vocabulary entry. :attr:`MemoryEstimate.process` is the
  whole process: ``total - headroom + runtime`` (the headroom is the fit check's margin, not memory the process
  holds), what `specchat models` shows and ``benchmarks/memory_vs_llama.py`` compares
  with the peak resident memory measured.

The KV term counts every slot of the context; on CPU the cache's pages are reserved as tokens arrive
(``kv_cache._zeroed``), so a short chat holds less, and a full context about that.

A model whose sizes are not known yet (a hub source not in the cache, without numbers in models.yaml) has no
estimate: ``MemoryEstimate.known`` is False, ``check_fits`` does not refuse it, and the engine checks again once
the download has brought its files (``engine.load_engine``).

On CPU the engine also keeps a oneDNN-packed copy of the float32 linear weights when that copy fits in the
memory still free after loading (``cpu_linear.py``: faster verification passes). It is optional, so it
is not part of the estimate that decides whether a pair fits.

``dtype: auto`` counts float32 on CPU and 2 bytes on CUDA, as loading does. The scratch term assumes the
engine prefills long prompts in chunks of at most PREFILL_CHUNK tokens (backend/limits.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

from specchat.backend.errors import InsufficientMemoryError
from specchat.backend.limits import MAX_GAMMA, NATIVE_PREFILL_CHUNK, PREFILL_CHUNK
from specchat.backend.models.catalog.config import TORCH_QUANTIZATIONS, ModelSpec, PairConfig
from specchat.backend.models.catalog.model_spec import GGUF_KINDS

if TYPE_CHECKING:
    import torch

# A device is a torch.device or its name ("cpu", "cuda:1"): `specchat models` estimates without importing torch.
Device = Union["torch.device", str]


def device_type(device: Device) -> str:
    """ "cpu" or "cuda" (a torch.device's ``type``, or the part of a name before its index)."""
    return device.type if not isinstance(device, str) else device.partition(":")[0]


HEADROOM = 0.08
# Resident memory of a specchat process besides the model's terms (Python, torch 2.13's CPU build and the engine's
# modules, less the start's code pages that engine/heap.py hands back, plus the code a reply runs; the native
# library and what loading leaves), and of the tokenizer per vocabulary entry (the ``tokenizers`` BPE tables),
# fitted to the peaks of three files at a full context on the Zen 4 (benchmarks/RESULTS.md, "Memory to llama.cpp's
# level" and "The libraries' code pages").
RUNTIME_BYTES = 190 * 2**20
TOKENIZER_BYTES_PER_TOKEN = 290
LOGIT_ROWS = MAX_GAMMA + 1  # the rows a verification at the largest γ keeps (a prefill chunk keeps one)
# Per logit of a kept row, beyond the model's output: float32 copy (4), penalised copy (4); per logit of the rows
# whose noise is drawn at once (sampling.PICK_ROWS): the int64 hash and its scratch (16), the float64 noise (8)
# and the float64 scores (8).
DECISION_BYTES = 8
NOISE_BYTES = 32
PICK_ROWS = 4  # sampling.PICK_ROWS (not imported: this module is read without the sampling code)
SCORE_BUDGET = 1 << 21  # float32 attention scores the native pass holds at most (csrc/attention_pass.cpp: kBudget)
NF4_BYTES_PER_WEIGHT = 0.5 + 4 / 64  # 4-bit code + float32 absmax per 64-weight block (no double quant)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    target_weights: int
    draft_weights: int
    target_kv: int
    draft_kv: int
    scratch: int
    graphs: int  # CUDA graphs' static buffers and memory pool (0 off CUDA)
    headroom: int
    total: int  # bytes, the sum of all the above
    known: bool = True  # False: a model's sizes are not known yet (the numbers above are then meaningless)
    runtime: int = 0  # CPU: the process before any model (Python, torch, tokenizer); not in ``total``

    @property
    def process(self) -> int:
        """The whole process: what loading adds (``total`` less the fit check's headroom) and what it holds before
        (``runtime``)."""
        return self.total - self.headroom + self.runtime

    def describe(self, context_length: int) -> str:
        """One line naming each term, for messages and `specchat models`."""
        runtime = f", runtime {format_bytes(self.runtime)} (Python, torch, tokenizer)" if self.runtime else ""
        return (
            f"target weights {format_bytes(self.target_weights)}, draft weights "
            f"{format_bytes(self.draft_weights)}, KV caches {format_bytes(self.target_kv + self.draft_kv)} "
            f"for {context_length} tokens, scratch {format_bytes(self.scratch)}"
            f"{f', CUDA graphs {format_bytes(self.graphs)}' if self.graphs else ''}, 8% headroom "
            f"{format_bytes(self.headroom)}{runtime}"
        )


def format_bytes(n: int | float) -> str:
    """Binary units with 3 significant digits: 512 B, 1.50 KiB, 15.2 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def dtype_bytes(spec: ModelSpec, device: Device) -> int:
    """Bytes per element of the compute dtype (activations, KV cache, unquantised weights)."""
    if spec.dtype != "auto":
        return _DTYPE_BYTES[spec.dtype]
    if spec.quantization in TORCH_QUANTIZATIONS:
        return 2  # bfloat16: the int4/int8 kernels' activations and the KV cache (loading.py)
    return 2 if device_type(device) == "cuda" else 4


def _torch_quantized_bytes(spec: ModelSpec, device: Device) -> int:
    """int4-torch / int8-torch (``quantized.py``): decoder linears int4 with a bfloat16 scale and zero per 32
    weights, or int8 with a bfloat16 scale per row; the head an int8 copy of its own (tied or not); the token
    embedding GGUF Q8_0 (a byte plus a float32 scale per 32) from a GGUF, else float at load dtype."""
    embedding = spec.vocab_size * spec.hidden_size
    linear = max(spec.params - embedding * (1 if spec.tie_word_embeddings else 2), 0)
    per_linear = 0.5 + 4 / 32 if spec.quantization == "int4-torch" else 1 + 2 / spec.hidden_size
    from_gguf = spec.kind in GGUF_KINDS
    embed_bytes = embedding * (
        1 + 4 / 32
        if from_gguf
        else (4 if spec.dtype == "auto" and device_type(device) == "cpu" else _DTYPE_BYTES.get(spec.dtype, 2))
    )
    head_bytes = embedding * (1 + 2 / spec.hidden_size)
    return int(linear * per_linear + embed_bytes + head_bytes)


def as_stored(spec: ModelSpec, device: Device) -> bool:
    """Whether the engine will run ``spec`` on the CPU native model (``native_loading.native_reason``'s conditions,
    read offline: CPU; no bitsandbytes quantization, no remote code; an architecture it covers; a GGUF of any
    ``quantization``, or a safetensors checkpoint with ``quantization: none``; kernels that can be built here and
    are not turned off with ``SPECCHAT_NATIVE=0``). Its weights are then the files' own blocks
    (:func:`native_weight_bytes`), its KV cache :func:`kv_dtype_bytes`, its scratch :func:`native_scratch_bytes`."""
    from specchat.backend.kernels.native_types import FAMILIES

    if device_type(device) != "cpu" or spec.quantization in ("nf4", "int8") or spec.trust_remote_code:
        return False
    if spec.architecture not in FAMILIES or (spec.kind not in GGUF_KINDS and spec.quantization != "none"):
        return False
    return native_unavailable_here() is None


def native_unavailable_here() -> str | None:
    """:func:`native_unavailable` for this process's environment (its compiler, PATH and switch)."""
    from specchat.backend.kernels import native_build

    return native_unavailable(os.environ.get("CXX"), os.environ.get("PATH"), os.environ.get(native_build.SWITCH))


@functools.lru_cache(maxsize=8)
def native_unavailable(cxx: str | None, path: str | None, switch: str | None) -> str | None:  # noqa: ARG001 - the key
    """``native_build.unavailable()`` once per environment that decides it: it searches PATH for a compiler and
    ninja, and a listing of 1,000 pairs asks four times a pair."""
    from specchat.backend.kernels import native_build

    return native_build.unavailable()


def native_weight_bytes(spec: ModelSpec) -> int:
    """The native model's weight bytes: the files' bytes per stored type (``spec.weight_types``), except types its
    kernels lack (e.g. Q3_K, IQ4_XS), which the loader de-quantises to F16: 2 bytes per weight of those."""
    from specchat.backend.kernels.native_types import GGML_TYPES

    total = 0
    for name, size in spec.weight_types:
        per_block = _ggml_block(name) if name not in GGML_TYPES else None
        total += size if per_block is None else size // per_block[1] * per_block[0] * 2
    return total or spec.weight_bytes


def _ggml_block(name: str) -> tuple[int, int] | None:
    """(weights, bytes) per block of a GGUF type name, or None for a name that is not one (safetensors totals)."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    except KeyError:
        return None


def kv_dtype_bytes(spec: ModelSpec, device: Device) -> int:
    """Bytes per cached K/V value: the native model keeps a GGUF's cache in float16 and a checkpoint's in its
    dtype (bfloat16, else float32), as ``native_loading.load`` chooses; other paths the compute dtype."""
    if as_stored(spec, device):
        return 2 if spec.kind in GGUF_KINDS or spec.dtype == "bfloat16" else 4
    return dtype_bytes(spec, device)


def native_scratch_bytes(spec: ModelSpec, context_length: int) -> int:
    """The native pass's buffers over one prefill chunk of :data:`NATIVE_PREFILL_CHUNK` rows
    (``csrc/model_forward.cpp``: float32 residual, normed input, q/k/v, attention output, o, gate/up, activation
    and down rows; int8 copies of the activations its kernels read), its attention scores (a group of rows over
    their keys, at most :data:`SCORE_BUDGET` floats), the rotary tables for every slot (cos and sin, float32, two
    bases at most) and the kept logits rows with the decision's copies. The MLP width comes from the parameter
    count (per layer: attention ``hidden x (q + 2 kv + o)`` plus ``3 x hidden x intermediate``)."""
    tokens = min(context_length, NATIVE_PREFILL_CHUNK)
    hidden, kv_width = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    q_width = max(hidden // max(spec.head_dim, 1), spec.num_kv_heads) * spec.head_dim
    embeddings = spec.vocab_size * hidden * (1 if spec.tie_word_embeddings else 2)
    per_layer = max(spec.params - embeddings, 0) // max(spec.num_layers, 1)
    inter = max((per_layer - hidden * (2 * q_width + 2 * kv_width)) // (3 * max(hidden, 1)), hidden)
    floats = tokens * (4 * hidden + 2 * q_width + 2 * kv_width + 3 * inter)
    quantised = tokens * (hidden + inter) * 2  # int8 values and their per-block scales, generously
    scores = min(SCORE_BUDGET, tokens * (q_width // max(spec.head_dim, 1)) * (context_length + 1)) * 4
    rotary = 2 * 2 * context_length * spec.head_dim * 4
    logits = LOGIT_ROWS * spec.vocab_size * (4 + DECISION_BYTES) + PICK_ROWS * spec.vocab_size * NOISE_BYTES
    return floats * 4 + quantised + scores + rotary + logits


def _stored_16bit(spec: ModelSpec) -> bool:
    types = dict(spec.weight_types)
    return bool(types) and set(types) <= {"BF16", "F16", "F32"} and types.get("F32", 0) * 10 < sum(types.values())


def weight_bytes(spec: ModelSpec, device: Device) -> int:
    per = dtype_bytes(spec, device)
    if spec.weight_bytes and spec.quantization not in ("nf4", "int8"):
        if as_stored(spec, device):
            return native_weight_bytes(spec)
        if spec.quantization == "none" and spec.dtype == "auto" and per == 2 and _stored_16bit(spec):
            return spec.weight_bytes  # CUDA loads a 16-bit checkpoint in its own dtype
    if spec.quantization == "none":
        return spec.params * per
    if spec.quantization in TORCH_QUANTIZATIONS:
        return _torch_quantized_bytes(spec, device)
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    linear = max(spec.params - embeddings, 0)
    if spec.quantization == "nf4":
        quantised = linear * NF4_BYTES_PER_WEIGHT
    else:  # int8: one byte a weight plus a float32 scale per output row (~hidden rows per hidden^2 weights)
        quantised = linear * (1 + 4 / spec.hidden_size)
    return int(quantised + embeddings * per)


def weights_basis(spec: ModelSpec, device: Device) -> str:
    """How :func:`weight_bytes` counted ``spec``'s weights, in a few words for `specchat models`."""
    if spec.quantization in ("nf4", "int8"):
        return f"{spec.quantization} (bitsandbytes)"
    if spec.weight_bytes and as_stored(spec, device):
        return "as stored in the file, CPU native"
    if spec.quantization in TORCH_QUANTIZATIONS:
        return f"re-quantised {spec.quantization}"
    if spec.weight_bytes and weight_bytes(spec, device) == spec.weight_bytes:
        return "as stored in the file"
    return f"{dtype_bytes(spec, device) * 8}-bit floats"


def kv_bytes(spec: ModelSpec, device: Device, tokens: int) -> int:
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * kv_dtype_bytes(spec, device) * tokens


def _forward_bytes(spec: ModelSpec, device: Device, context_length: int, tokens: int, rows: int, per_logit: int) -> int:
    """Activations of one forward over ``tokens`` new tokens against ``context_length`` keys, keeping ``rows``
    logits rows of ``per_logit`` bytes each."""
    heads = max(spec.hidden_size // max(spec.head_dim, 1), spec.num_kv_heads)
    activations = tokens * spec.hidden_size * 16 * dtype_bytes(spec, device)
    scores = heads * tokens * context_length * 4
    gathered_kv = 2 * spec.num_kv_heads * spec.head_dim * context_length * dtype_bytes(spec, device)  # one layer
    return activations + scores + gathered_kv + rows * spec.vocab_size * per_logit


def scratch_bytes(spec: ModelSpec, device: Device, context_length: int) -> int:
    if as_stored(spec, device):
        return native_scratch_bytes(spec, context_length)
    tokens = min(context_length, PREFILL_CHUNK)
    noise = PICK_ROWS * spec.vocab_size * NOISE_BYTES
    per_logit = dtype_bytes(spec, device) + DECISION_BYTES
    return _forward_bytes(spec, device, context_length, tokens, LOGIT_ROWS, per_logit) + noise


def graph_bytes(spec: ModelSpec, device: Device, context_length: int) -> int:
    """What one model's CUDA-graph runner holds (0 off CUDA): static buffers plus its private pool."""
    if device_type(device) != "cuda":
        return 0
    from specchat.backend.kernels.cuda_graphs import DEFAULT_TOKEN_BUCKETS, static_bytes

    nb = DEFAULT_TOKEN_BUCKETS[-1]
    pool = _forward_bytes(spec, device, context_length, nb, nb, dtype_bytes(spec, device))
    return static_bytes(spec.vocab_size, context_length) + pool


def runtime_bytes(spec: ModelSpec) -> int:
    """What a CPU process holds before loading ``spec``'s weights: the runtime and the tokenizer."""
    return RUNTIME_BYTES + spec.vocab_size * TOKENIZER_BYTES_PER_TOKEN


def estimate_pair(pair: PairConfig, device: Device, context_length: int | None = None) -> MemoryEstimate:
    """The footprint of ``pair`` on ``device`` (``context_length`` defaults to the pair's)."""
    tokens = context_length or pair.context_length
    draft = pair.draft if pair.drafter == "draft-model" else None
    target = pair.local_target
    target_weights = weight_bytes(target, device)
    target_kv = kv_bytes(target, device, tokens)
    draft_weights = weight_bytes(draft, device) if draft else 0
    draft_kv = kv_bytes(draft, device, tokens) if draft else 0
    scratch_each = [scratch_bytes(target, device, tokens), scratch_bytes(draft, device, tokens) if draft else 0]
    # The native model keeps its pass's buffers between passes: a native target and draft hold theirs together.
    both_native = draft is not None and as_stored(target, device) and as_stored(draft, device)
    scratch = sum(scratch_each) if both_native else max(scratch_each)
    graphs = graph_bytes(target, device, tokens) + (graph_bytes(draft, device, tokens) if draft else 0)
    subtotal = target_weights + target_kv + draft_weights + draft_kv + scratch + graphs
    headroom = int(subtotal * HEADROOM)
    known = target.sizes_known and (draft is None or draft.sizes_known)
    return MemoryEstimate(
        target_weights=target_weights,
        draft_weights=draft_weights,
        target_kv=target_kv,
        draft_kv=draft_kv,
        scratch=scratch,
        graphs=graphs,
        headroom=headroom,
        total=subtotal + headroom,
        known=known,
        runtime=runtime_bytes(target) if device_type(device) == "cpu" else 0,
    )


def _cgroup_available() -> int | None:
    """Memory left under a cgroup v2 limit (containers), or None when unlimited / not readable."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip()), 0)
    except (OSError, ValueError):
        return None


def free_memory(device: Device) -> int:
    """Bytes free for a new allocation: CUDA ``mem_get_info``; CPU MemAvailable (and the cgroup limit)."""
    if device_type(device) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    if available is None:  # not Linux: physical pages not in use
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = _cgroup_available()
    return min(available, limited) if limited is not None else available


def check_fits(pair: PairConfig, device: Device, context_length: int | None = None) -> MemoryEstimate:
    """The estimate, or InsufficientMemoryError with the numbers and what to do when it exceeds free memory."""
    estimate = estimate_pair(pair, device, context_length)
    free = free_memory(device)
    if estimate.known and estimate.total > free:
        tokens = context_length or pair.context_length
        raise InsufficientMemoryError(
            f"pair '{pair.name}' needs about {format_bytes(estimate.total)} on {device} "
            f"({estimate.describe(tokens)}) but only {format_bytes(free)} is free; choose a smaller pair "
            f"(`specchat models`), lower context_length in {pair.source_file}, use quantization: nf4, or free "
            "memory on the device"
        )
    return estimate
