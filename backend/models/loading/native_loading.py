"""Loading a model for the native pass (``backend/kernels/native_model.py``): a GGUF file's tensors as the file
stores them, or a transformers checkpoint's safetensors (float32 / bfloat16 / float16) as stored.

Contract:
- :func:`native_reason(spec, device, attn_implementation)` is None when the native model will run this spec
  (CPU, the paged attention asked for, a GGUF or packaged source of an architecture in
  ``gguf_arch.ARCHS``, or a local / hub safetensors checkpoint with ``quantization: none``) and
  the library is usable (``kernels.native.ensure``, which builds it on a machine's first use: in the background
  unless ``SPECCHAT_NATIVE_BUILD=wait``, the reason then starting with ``native_library.BUILDING``, and the
  engine swaps the native model in between replies once it is ready: ``engine/upgrade.py``); "" where it is
  not in question (CUDA, a model loaded outside the engine); else why not, in one line (the caller falls back
  and says so).
- :func:`from_gguf(gguf, config)` / :func:`from_safetensors(folder, config)` return a :class:`NativeCausalLM`
  whose weights are QWeights holding the stored blocks (one copy each: the file's pages are not kept, nor any
  float copy); llama.cpp's permuted q/k rows of llama-architecture files are put back in transformers' order
  by moving whole rows of blocks. Types the kernels lack are de-quantised to F16 and named in ``notes``. A
  file whose tensors do not make a complete model raises :class:`ModelLoadError` naming the file and tensor.
"""

from __future__ import annotations

import contextlib
import mmap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import native
from specchat.backend.kernels.native_model import GGML_TYPES, TYPE_NAMES, NativeModel, float_qweight, qweight
from specchat.backend.models.catalog.config import TORCH_QUANTIZATIONS, ModelSpec
from specchat.backend.models.gguf import gguf_file
from specchat.backend.models.gguf.gguf_arch import ARCHS, GgufArchError
from specchat.backend.models.gguf.gguf_file import GgufFile
from specchat.backend.models.gguf.gguf_tensors import CONFIG_ROLES, config_of, roles_of
from specchat.backend.models.loading.native_arch import (
    HF_NAMES,
    LAYER_VECTORS,
    MATRICES,
    NativeUnsupported,
    architecture,
    names_for,
)

Progress = Callable[[str, "float | None"], None]
BITSANDBYTES = ("nf4", "int8")


class NativeCausalLM:
    """A model the native pass runs: where a transformers model would sit in ``LoadedModel.model``."""

    def __init__(self, config: Any, native_model: NativeModel, fill: _Fill) -> None:
        self.config = config
        self.native = native_model
        self.description = fill.description()  # e.g. "Q4_1 as stored"
        self.notes = fill.notes()
        self.weight_bytes = fill.nbytes  # every weight, as stored
        # What one pass reads: every weight but the embedding's rows, unless the head is the embedding.
        self.bytes_per_token = fill.nbytes - (0 if fill.tied else fill.embed_bytes)
        self.generation_config: Any = None
        self.spec: ModelSpec | None = None  # set by load(): a transformers twin loads from it (bench baselines)
        self.spec_device = torch.device("cpu")

    def eval(self) -> NativeCausalLM:
        return self

    def set_attn_implementation(self, name: str) -> None:
        """The native pass attends over the paged cache itself: any name is accepted and ignored."""

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The output layer's rows of ``ids`` [n] -> [n, hidden] float32, from the file's own blocks (train-head
        starts a draft head's output layer with them)."""
        return self.native.output_rows(ids)

    def final_norm_scale(self) -> torch.Tensor | None:
        """The final norm's multiplier [hidden] float32 (train-head starts a draft head's norm with it)."""
        return self.native.final_norm_scale()

    def get_input_embeddings(self) -> Any:
        """The input embedding as a function of ids [n] -> [n, hidden] float32 (what a draft head embeds its
        tokens with), read from the file's own rows."""
        return self.native.embed


def native_reason(
    spec: ModelSpec,
    device: torch.device,
    attn_implementation: str,
    progress: Progress | None = None,
    gguf: Path | None = None,
) -> str | None:
    """See the module docstring (``gguf``: the spec's GGUF file, for packaged and gguf sources)."""
    from specchat.backend.kv.attention import ATTN_IMPLEMENTATION

    if device.type != "cpu" or attn_implementation != ATTN_IMPLEMENTATION:
        return ""  # not in question: CUDA keeps PyTorch's kernels; a model loaded outside the engine is transformers'

    if spec.quantization in BITSANDBYTES:
        return f"quantization: {spec.quantization} asks for bitsandbytes"
    if spec.trust_remote_code:
        return "the model's own code (trust_remote_code) runs through transformers"
    if gguf is None and spec.quantization in TORCH_QUANTIZATIONS:
        return f"quantization: {spec.quantization} re-quantises its float weights (none runs them natively, as stored)"
    if gguf is not None:
        try:
            kind = gguf_file.read_gguf(gguf).architecture
        except (OSError, ValueError):
            kind = None  # the loader reports an unreadable file as it always did
        if kind not in ARCHS:
            return f"the native model does not read {kind!r} GGUF files yet (it reads {', '.join(ARCHS)})"
    why = native.ensure(progress, wait=not native.background_builds())
    if why is None:
        return None
    if native.building():  # the model runs a path that needs no compiler until then (engine/upgrade.py)
        return f"{why}; they take over between replies when ready"
    return f"the CPU kernels are unavailable: {why}"


def load(folder: Path, spec: ModelSpec, device: torch.device, tokenizer: Any, progress: Progress | None,
         gguf: Path | None):  # fmt: skip
    """The native model of ``spec`` from ``folder`` (its converted metadata, for a GGUF) as ``(model, dtype,
    generation values, folder, tokenizer)``, or why the native model does not cover it (one line)."""
    from specchat.backend.models.loading import skeleton

    try:
        if gguf is not None:
            if progress is not None:
                progress(f"Loading {gguf.name} for the CPU kernels, as stored", None)
            try:
                parsed = gguf_file.read_gguf(gguf)
            except ValueError as error:
                raise ModelLoadError(
                    f"{gguf}: cannot read this GGUF file ({error}); if it is truncated or damaged, download it again"
                ) from error
            try:  # the file's own configuration (gguf_arch / gguf_tensors), rope factors included
                values = config_of(parsed)
            except GgufArchError as error:
                raise NativeUnsupported(str(error)) from None
            values = light_defaults(values)
            config: Any = skeleton.LightConfig(values, str(gguf)) if skeleton._usable(values) else None
            if config is None:  # transformers only where the light config does not cover it (the default needs none)
                from transformers import AutoConfig

                config = AutoConfig.for_model(**values)
            model = from_gguf(parsed, config)
            del parsed  # the file's map goes: every weight is a QWeight's own copy now
            # the KV cache in float16, as llama.cpp's default: 3 more mantissa bits than bfloat16 at the same size
            dtype = torch.float16
        else:
            config = _transformers_config(folder, spec)
            architecture(config)  # before any weight is read
            if progress is not None:
                progress(f"Loading {spec.source} for the CPU kernels, as stored", None)
            model = from_safetensors(folder, config)
            dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    except NativeUnsupported as error:
        return f"the native model does not cover {error}"
    _return_freed_memory()
    try:
        generation = skeleton.generation_values(folder)
    except (OSError, ValueError):
        generation = {}
    model.generation_config = generation
    model.spec, model.spec_device = spec, device
    return model, dtype, generation, folder, tokenizer


def light_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a GGUF's configuration) with the fields a qwen2 file does not state set as transformers'
    Qwen2Config sets them (no sliding window: ``use_sliding_window`` defaults to False, so every layer is full
    attention), so that the light config covers it and the native path need not import transformers (seconds of a
    start: ``benchmarks/RESULTS.md``, "A qwen2 GGUF on the native path")."""
    if values.get("model_type") != "qwen2" or "layer_types" in values or values.get("use_sliding_window"):
        return values
    layers = values.get("num_hidden_layers")
    if type(layers) is not int:
        return values
    return {"sliding_window": None, "layer_types": ["full_attention"] * layers, **values}


def _transformers_config(folder: Path, spec: ModelSpec) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{folder}: cannot read config.json of {spec.source} ({error})") from error


def _return_freed_memory() -> None:
    """Give the loader's transient buffers back to the OS (glibc keeps freed heap pages resident otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _raw(tensor: gguf_file.GgufTensor) -> torch.Tensor:
    with warnings.catch_warnings():  # a view of the read-only map: QWeight copies it, nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(tensor.raw)


class _Fill:
    """Puts tensors into a NativeModel, counting types and bytes for the description."""

    def __init__(self, model: NativeModel, where: Path) -> None:
        self.model, self.where = model, where
        self.types: dict[str, int] = {}
        self.converted: dict[str, int] = {}
        self.nbytes = 0
        self.embed_bytes = 0
        self.tied = True

    def count(self, name: str, nbytes: int) -> None:
        self.types[name] = self.types.get(name, 0) + 1
        self.nbytes += nbytes

    def description(self) -> str:
        order = sorted(self.types, key=lambda name: -self.types[name])
        return f"{', '.join(order)} as stored"

    def notes(self) -> list[str]:
        return [
            f"{count} {name} tensor(s) have no kernel: de-quantised to F16" for name, count in self.converted.items()
        ]


def _gguf_weight(fill: _Fill, tensor: gguf_file.GgufTensor, order: torch.Tensor | None):
    rows, cols = tensor.shape[0], tensor.shape[-1]
    if len(tensor.shape) != 2:
        raise ModelLoadError(f"{fill.where}: tensor {tensor.name!r} has shape {tensor.shape}, not a matrix")
    if tensor.type_name not in GGML_TYPES:
        fill.converted[tensor.type_name] = fill.converted.get(tensor.type_name, 0) + 1
        weight = gguf_file.dequantize(tensor)
        weight = (weight[order] if order is not None else weight).half()
        fill.count("F16", weight.numel() * 2)
        return float_qweight(weight)
    raw = _raw(tensor)
    if order is not None:
        raw = raw[order]  # whole rows of blocks: the file's values, in transformers' row order
    fill.count(tensor.type_name, raw.numel())
    made = qweight(raw, tensor.ggml_type, rows, cols)
    _release(tensor)
    return made


def _release(tensor: gguf_file.GgufTensor) -> None:
    """Take the file's pages that ``tensor`` was copied from out of this process (they stay in the page cache, and
    are read again if touched): the peak while loading is the copies, not the copies plus the file."""
    mapping = tensor.raw.base
    while mapping is not None and not isinstance(mapping, mmap.mmap):
        mapping = mapping.obj if isinstance(mapping, memoryview) else getattr(mapping, "base", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = tensor.raw.ctypes.data - np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(start + tensor.raw.nbytes, len(mapping))
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def from_gguf(gguf: GgufFile, config: Any) -> NativeCausalLM:
    """See the module docstring. Tensor names, roles, llama's permuted q/k rows and gemma's stored 1 + w norms come
    from the GGUF tables (``gguf_tensors.roles_of``, ``gguf_arch.ARCHS``): the native model adds no table."""
    row = ARCHS.get(gguf.architecture)
    if row is None:
        raise NativeUnsupported(f"GGUF architecture {gguf.architecture!r} (native: {', '.join(ARCHS)})")
    arch = architecture(config)
    if row.norm_plus_one:
        from dataclasses import replace

        arch = replace(arch, norm_add_one=False)  # the file's norms already hold 1 + w: x · (stored w), as stored
    sizes = {"num_hidden_layers": arch.layers, "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads}
    try:
        roles = roles_of(gguf, sizes)
    except GgufArchError as error:
        raise ModelLoadError(
            f"{error}; it does not hold a complete {arch.family} model (a damaged or unfinished file?)"
        ) from None
    model = NativeModel(arch)
    fill = _Fill(model, gguf.path)
    found: dict[str, torch.ScriptObject] = {}
    final: torch.Tensor | None = None
    for name, role in roles.items():
        stored = gguf.tensors[name]
        order = gguf_file.unpermute_rows(stored.shape[0], role.unpermute_heads) if role.unpermute_heads else None
        if role.role in CONFIG_ROLES:
            continue  # rotary factors: already in the config (gguf_tensors.config_of)
        if role.role == "o_bias":
            raise NativeUnsupported("attention output biases")
        if role.role in ("embed", "head"):
            found[role.role] = _gguf_weight(fill, stored, None)
            if role.role == "embed":
                fill.embed_bytes = stored.raw.nbytes
        elif role.role == "final_norm":
            final = gguf_file.dequantize(stored).reshape(-1)
        elif role.role in MATRICES and role.layer is not None:
            model.set_layer_weight(role.layer, role.role, _gguf_weight(fill, stored, order))
        elif role.role in LAYER_VECTORS and role.layer is not None:
            value = gguf_file.dequantize(stored).reshape(-1)
            model.set_layer_vector(role.layer, role.role, value[order] if order is not None else value)
    assert final is not None  # noqa: S101 - roles_of requires it
    model.set_weight("embed", found["embed"])
    if "head" in found:
        model.set_weight("head", found["head"])
        fill.tied = False
    model.set_final_norm(final)
    _complete(model, gguf.path, arch.family)
    return NativeCausalLM(config, model, fill)


def from_safetensors(folder: Path, config: Any) -> NativeCausalLM:
    """See the module docstring."""
    from safetensors import safe_open

    arch = architecture(config)
    names = names_for(HF_NAMES, arch.family)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights")
    handles = [safe_open(str(path), framework="pt") for path in files]
    where = {key: handle for handle in handles for key in handle.keys()}  # noqa: SIM118 - not a dict
    model = NativeModel(arch)
    fill = _Fill(model, Path(folder))

    def get(name: str) -> torch.Tensor | None:
        handle = where.get(name)
        return None if handle is None else handle.get_tensor(name)

    def matrix(name: str):
        weight = get(name)
        if weight is None:
            return None
        if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ModelLoadError(f"{folder}: {name} is {weight.dtype} (float32, bfloat16 or float16 only)")
        fill.count(TYPE_NAMES[{torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}[weight.dtype]],
                   weight.numel() * weight.element_size())  # fmt: skip
        return float_qweight(weight)

    for i in range(arch.layers):
        for native_name in MATRICES:
            if native_name in names and (weight := matrix(names[native_name].format(i=i))) is not None:
                model.set_layer_weight(i, native_name, weight)
        for native_name in LAYER_VECTORS:
            if native_name in names and (value := get(names[native_name].format(i=i))) is not None:
                model.set_layer_vector(i, native_name, value)
        if names["o_bias"].format(i=i) in where:
            raise NativeUnsupported("attention output biases")
    embed = matrix(names["embed"])
    final = get(names["final_norm"])
    if embed is None or final is None:
        raise ModelLoadError(f"{folder}: {names['embed']} or {names['final_norm']} is missing from the safetensors")
    model.set_weight("embed", embed)
    stored_embed = get(names["embed"])
    assert stored_embed is not None  # noqa: S101 - matrix() found it
    fill.embed_bytes = arch.vocab * arch.hidden * {torch.float32: 4}.get(stored_embed.dtype, 2)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = None if tied else matrix(names["head"])
    if head is not None:
        model.set_weight("head", head)
        fill.tied = False
    model.set_final_norm(final)
    _complete(model, Path(folder), arch.family)
    return NativeCausalLM(config, model, fill)


def _complete(model: NativeModel, where: Path, family: str) -> None:
    """ModelLoadError naming the file and the first tensor missing or misshapen for a whole ``family`` model."""
    try:
        model.check()
    except RuntimeError as error:
        detail = str(error).splitlines()[0].removeprefix("NativeModel: ")
        raise ModelLoadError(
            f"{where}: {detail}; it does not hold a complete {family} model (a damaged or unfinished file?)"
        ) from None
