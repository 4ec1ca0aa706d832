"""What loading a model produces and the pieces both load paths share: :class:`LoadedModel`, the device and
dtype rules, where a spec's GGUF file is, and the PyTorch int4 / int8 path for a GGUF (``quantized.py``).
``loading.py`` is the entry point (its docstring is the contract); it re-exports the public names here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specchat.backend.errors import ConfigError, ModelLoadError
from specchat.backend.models.catalog.config import TORCH_QUANTIZATIONS, ModelSpec
from specchat.backend.models.catalog.model_spec import GGUF_KINDS
from specchat.backend.models.facts import spec_facts
from specchat.backend.models.hub import hub_gguf
from specchat.backend.models.loading import skeleton
from specchat.backend.models.loading.capture import Progress

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_GENERATION_KEYS = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "max_new_tokens",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
)


class CacheDamage(ModelLoadError):
    """A file of a converted-model cache folder cannot be read: the folder is made again (``_healing``)."""


@dataclass
class LoadedModel:
    # eval mode, on device; a LightCausalLM runs only through the compact forward (backend/models/loading/skeleton.py)
    model: PreTrainedModel | skeleton.LightCausalLM
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype  # compute dtype (for nf4/int8: the dtype activations run in)
    generation_config: dict  # non-default sampling/eos settings of the model's generation_config (may be empty)
    path: Path | None = None  # the folder the weights came from
    # Why the native model (backend/models/loading/native_loading.py) does not run this model on CPU, in one line; None
    # when it runs it, or when it was never in question (CUDA).
    native_reason: str | None = None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/"auto": cuda if available else cpu. Accepts cpu, cuda, cuda:N (ConfigError/ModelLoadError else)."""
    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device {device!r}: not a device; use cpu, cuda or cuda:N") from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ConfigError(f"--device {device!r}: only cpu and cuda devices are supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ModelLoadError(
            f"--device {device!r}: no CUDA GPU is usable here (torch {torch.__version__} is {build}); use --device cpu"
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here; "
            f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
        )
    return torch.device("cuda", index)


def resolve_dtype(spec: ModelSpec, device: torch.device, checkpoint_dtype: Any = None) -> torch.dtype:
    """The compute dtype for ``spec`` on ``device`` (see module docstring for ``auto``)."""
    if spec.dtype != "auto":
        return _DTYPES[spec.dtype]
    if device.type != "cuda":
        return torch.float32
    if checkpoint_dtype in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def packaged_gguf_path(name: str = "smollm2-135m-instruct") -> Path:
    """The GGUF file of a packaged model, located through the installed distribution's file list."""
    try:
        return spec_facts.packaged_gguf_path(name)
    except spec_facts.PackagedMissing as exc:
        raise ModelLoadError(str(exc)) from None


def gguf_path(spec: ModelSpec) -> Path | None:
    """The GGUF file of a packaged or gguf source (None for other kinds)."""
    if spec.kind == "packaged":
        return packaged_gguf_path(spec.source.removeprefix("packaged:"))
    if spec.kind == "gguf":
        return Path(spec.path or spec.source)
    if spec.kind == "hub-gguf":  # fetched (with progress) by load_pair / load_model before anything asks here
        return hub_gguf.fetch(spec)
    return None


def _failure(spec: ModelSpec) -> type[ModelLoadError]:
    """The error for an unreadable file: in a conversion cache it is damage that converting again heals."""
    return CacheDamage if gguf_path(spec) is not None else ModelLoadError


def _reads_gguf_directly(spec: ModelSpec, native: bool = False) -> bool:
    """Whether the GGUF's weights are read from the file itself (the native model, int4 / int8 kernels), so only
    its tokenizer and configuration are converted."""
    return spec.kind in GGUF_KINDS and (native or spec.quantization in TORCH_QUANTIZATIONS)


def _weights_kwargs(folder: Path, spec: ModelSpec) -> dict:
    """Refuse pickle-only checkpoints unless allowed; safetensors are always preferred."""
    if any(folder.glob("*.safetensors")):
        return {"use_safetensors": True}
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
    if not pickles:
        raise _failure(spec)(f"{folder}: no weights found (*.safetensors) for {spec.source}; check the source")
    if not spec.allow_pickle:
        raise ModelLoadError(
            f"{folder}: {spec.source} has only pickle weights ({', '.join(pickles[:3])}), which "
            "can run arbitrary code when loaded; convert them to safetensors, or set "
            "allow_pickle: true in the model's block in models.yaml if you trust the source"
        )
    return {"use_safetensors": False}


def _quantization_config(spec: ModelSpec, dtype: torch.dtype) -> Any:
    if spec.quantization == "none" or spec.quantization in TORCH_QUANTIZATIONS:
        return None
    try:
        import bitsandbytes  # noqa: F401 - only to report a missing install clearly
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise ModelLoadError(
            f"quantization: {spec.quantization} for {spec.source} needs bitsandbytes; run: pip install bitsandbytes"
        ) from None
    if spec.quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _load_gguf_quantized(
    folder: Path,
    spec: ModelSpec,
    config: Any,
    device: torch.device,
    tokenizer: Any,
    attn_implementation: str,
    progress: Progress | None,
) -> LoadedModel:
    """The GGUF's weights as stored, in PyTorch's int4/int8 kernels (``quantized.from_gguf``)."""
    from specchat.backend.models.gguf.gguf_file import read_gguf
    from specchat.backend.models.loading.quantized import compute_dtype, from_gguf

    path = gguf_path(spec)
    assert path is not None  # noqa: S101 - _reads_gguf_directly checked the kind
    config._attn_implementation = attn_implementation
    try:
        model, notes = from_gguf(read_gguf(path), config, spec.quantization, device, progress=progress)
    except ValueError as exc:  # GgufFormatError: the file itself is damaged or not what its header says
        raise ModelLoadError(
            f"{path}: cannot read this GGUF file ({exc}); if it is truncated or damaged, download it again"
        ) from exc
    if progress is not None:
        progress(f"Loaded {path.name} as {spec.quantization}: " + "; ".join(notes), None)
    if isinstance(model, skeleton.LightCausalLM):  # transformers stays unimported (see light_tokenizer.py)
        try:
            generation = skeleton.generation_values(folder)
        except (OSError, ValueError) as exc:
            raise CacheDamage(f"{folder / 'generation_config.json'}: unreadable ({exc})") from exc
        model.generation_config = generation  # quantized.transformers_model makes it transformers' object
    else:
        from transformers import GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(folder).to_diff_dict()
        except (OSError, ValueError) as exc:
            raise CacheDamage(f"{folder}: generation_config.json is unreadable ({exc})") from exc
        model.generation_config = GenerationConfig(**generation)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        device=device,
        dtype=compute_dtype(device),
        generation_config={k: generation[k] for k in _GENERATION_KEYS if k in generation},
        path=folder,
    )


def _fetch_hub_files(specs: list[ModelSpec], progress: Progress | None) -> None:
    """Download the ``hf:`` GGUF files among ``specs`` (after the download was agreed to), reporting progress."""
    for spec in specs:
        if spec.kind == "hub-gguf":
            hub_gguf.fetch(spec, progress)
