"""Load a pair's draft head: find its folder, check it fits the target BEFORE reading weights, then load it.

Contract: :func:`load_head(spec, drafter, target_config, device, ...)` returns a :class:`LoadedHead` (the module,
the taps it reads, its drafter's name) or raises :class:`~specchat.backend.errors.ModelLoadError` naming the head,
the field and both values when the head was made for another target (hidden size, vocabulary, the layers its
taps read). A hub head is downloaded only after ``confirm_download(bytes)`` agreed (as models are,
``models/hub.py``); a packaged head missing from this installation raises :class:`HeadMissing` (the caller
then runs the pair without it). Weights: ``*.safetensors``; pickle files (``pytorch_model.bin``,
``medusa_lm_head.pt``) only with ``allow_pickle``, read with ``torch.load(weights_only=True)``. Key names are the
published ones (``eagle3.py``, ``medusa.py``); a missing or unexpected key is an error naming it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import block_linear, blocks
from specchat.backend.limits import HEAD_DRAFTERS
from specchat.backend.models.catalog.config import ModelSpec, PairConfig
from specchat.backend.models.catalog.config_head import HeadSpec
from specchat.backend.speculative.heads.eagle3 import Eagle3Config, Eagle3Head, default_taps
from specchat.backend.speculative.heads.medusa import MedusaConfig, MedusaHeads, medusa_state

MAX_CONFIG_BYTES = 1 << 20
_PICKLES = ("pytorch_model.bin", "medusa_lm_head.pt", "model.pt")
log = logging.getLogger(__name__)


class HeadMissing(ModelLoadError):
    """A packaged head that this installation does not include."""


@dataclass(frozen=True, slots=True)
class LoadedHead:
    drafter: str  # "eagle3" | "medusa"
    module: nn.Module  # Eagle3Head | MedusaHeads
    taps: tuple[int, ...]  # the target's hidden states it reads (runner tap indices)
    source: str


def head_folder(spec: HeadSpec, confirm_download: Callable[[int], bool] | None, progress=None) -> Path:
    """The local folder of ``spec``'s files (a hub head is fetched after the download was agreed)."""
    if spec.kind == "packaged":
        folder = spec.packaged_folder()
        if not (folder / "config.json").is_file():
            raise HeadMissing(f"the packaged head {spec.source} is not part of this installation ({folder})")
        return folder
    if spec.kind == "local":
        return Path(spec.path or spec.source)
    from specchat.backend.models.catalog.config import ModelSpec
    from specchat.backend.models.hub import repos as hub

    model = ModelSpec(
        source=spec.source,
        kind="hub",
        revision=spec.revision,
        dtype="auto",
        quantization="none",
        params=1,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        hidden_size=1,
        vocab_size=1,
        download_bytes=0,
        gated=False,
        allow_pickle=spec.allow_pickle,
    )
    hub.confirm_download([model], confirm_download, f"the draft head {spec.source}")
    return hub.snapshot(model, progress=progress)


def read_config(folder: Path, source: str) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"head {source}: cannot read {path} ({exc}); is this a head's folder?") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"head {source}: {path} is not a JSON object of a config")
    return data


def target_sizes(config) -> tuple[int, int, int]:
    """(hidden size, layers, vocabulary) of a loaded target's config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)


def kind_of(data: Mapping[str, Any]) -> str:
    """The drafter a head's config.json is for: "medusa" when it names Medusa heads, else "eagle3"."""
    return "medusa" if "medusa_num_heads" in data else "eagle3"


def _mismatch(source: str, field: str, head_value: Any, target_field: str, target_value: Any, target: str) -> None:
    raise ModelLoadError(
        f"head {source}: field '{field}' = {head_value} does not fit the target {target}, whose {target_field} is "
        f"{target_value}: this head was trained for another model; give the pair a head made for {target} "
        "(or train one: `specchat train-head`)"
    )


def check_fits(
    drafter: str, data: Mapping[str, Any], sizes: tuple[int, int, int], source: str, target: str
) -> tuple[int, ...]:
    """Compare a head's config.json with the target's (hidden size, layers, vocabulary); the taps it reads.
    Raises on the first misfit, naming the field and both values."""
    hidden, layers, vocab = sizes
    if kind_of(data) != drafter:
        raise ModelLoadError(
            f"head {source} is a {kind_of(data)} head (its config.json), but the pair's drafter is {drafter}; "
            f"set drafter: {kind_of(data)} (or auto)"
        )
    if drafter == "eagle3":
        c = Eagle3Config.from_dict(data, f"head {source}")
        if c.target_hidden_size != hidden:
            field = "target_hidden_size" if "target_hidden_size" in data else "hidden_size"
            _mismatch(source, field, c.target_hidden_size, "hidden_size", hidden, target)
        if c.vocab_size != vocab:
            _mismatch(source, "vocab_size", c.vocab_size, "vocab_size", vocab, target)
        trained = data.get("target_num_hidden_layers")
        if isinstance(trained, int) and trained != layers:
            _mismatch(source, "target_num_hidden_layers", trained, "num_hidden_layers", layers, target)
        taps = c.taps or default_taps(layers)
        if max(taps) >= layers:
            _mismatch(source, "eagle_aux_hidden_state_layer_ids", list(taps), "num_hidden_layers", layers, target)
        return tuple(taps)
    c2 = MedusaConfig.from_dict(data, f"head {source}", hidden_size=hidden, vocab_size=vocab)
    if c2.hidden_size != hidden:
        _mismatch(source, "hidden_size", c2.hidden_size, "hidden_size", hidden, target)
    if c2.vocab_size != vocab:
        _mismatch(source, "vocab_size", c2.vocab_size, "vocab_size", vocab, target)
    return (layers,)  # the final normed hidden state


def read_weights(folder: Path, source: str, allow_pickle: bool) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    pickles = [folder / name for name in _PICKLES if (folder / name).is_file()]
    if not pickles:
        raise ModelLoadError(f"head {source}: no *.safetensors (nor {', '.join(_PICKLES)}) in {folder}")
    if not allow_pickle:
        raise ModelLoadError(
            f"head {source}: its weights are a pickle file ({pickles[0].name}); set allow_pickle: true in the "
            "pair's head block to read it (with torch.load(weights_only=True)), or convert it to safetensors"
        )
    loaded = torch.load(pickles[0], map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise ModelLoadError(f"head {source}: {pickles[0].name} does not hold a state dict")
    return {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


def _fill(module: nn.Module, state: Mapping[str, torch.Tensor], source: str, optional: set[str]) -> None:
    expected = module.state_dict()
    missing = sorted(k for k in expected if k not in state and k not in optional)
    unexpected = sorted(k for k in state if k not in expected)
    if missing or unexpected:
        what = f"missing {missing[:4]}" if missing else f"unexpected {unexpected[:4]}"
        raise ModelLoadError(f"head {source}: its weights do not have the published layout ({what})")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            want = tuple(expected[key].shape)
            raise ModelLoadError(f"head {source}: weight {key} has shape {tuple(value.shape)}, its config says {want}")
    module.load_state_dict({k: v for k, v in state.items()}, strict=False)


def build_head(
    drafter: str, data: Mapping[str, Any], state: Mapping[str, torch.Tensor], sizes: tuple[int, int, int], source: str
) -> nn.Module:
    """The head module from its config and weights (float32, on CPU)."""
    if drafter == "eagle3":
        c = Eagle3Config.from_dict(data, f"head {source}")
        head = Eagle3Head(c, fc_bias="fc.bias" in state, own_embedding="embed_tokens.weight" in state)
        state = dict(state)
        if "t2d" in state:
            state["t2d"] = state["t2d"].to(torch.bool)
        if "d2t" in state:
            state["d2t"] = state["d2t"].to(torch.long)
        _fill(head, state, source, optional={"d2t", "t2d"})
        return head.float()
    hidden, _, vocab = sizes
    heads = MedusaHeads(MedusaConfig.from_dict(data, f"head {source}", hidden_size=hidden, vocab_size=vocab))
    _fill(heads, medusa_state(state), source, optional=set())
    return heads.float()


@dataclass(frozen=True, slots=True)
class HeadPlan:
    """A head found and checked against the target's sizes from models.yaml, its weights not read yet."""

    spec: HeadSpec
    drafter: str
    folder: Path
    config: Mapping[str, Any]
    taps: tuple[int, ...]


def plan_head(
    spec: HeadSpec,
    drafter: str | None,
    sizes: tuple[int, int, int],
    *,
    target_name: str,
    confirm_download: Callable[[int], bool] | None = None,
    progress=None,
) -> HeadPlan:
    """Find ``spec``'s folder (a hub head downloaded once agreed) and check its config against the target's
    ``sizes`` (hidden size, layers, vocabulary): before any weight, the target's included, is read.
    ``drafter`` None (a pair's auto): whichever kind the head's config is."""
    folder = head_folder(spec, confirm_download, progress)
    data = read_config(folder, spec.source)
    kind = drafter or kind_of(data)
    taps = check_fits(kind, data, sizes, spec.source, target_name)
    return HeadPlan(spec=spec, drafter=kind, folder=folder, config=data, taps=taps)


def load_planned(
    plan: HeadPlan, target_config, device: torch.device, *, target_name: str, dtype: torch.dtype | None = None
) -> LoadedHead:
    """Read the weights of a planned head (checked again against the loaded target's config) onto ``device``
    in ``dtype`` (None: float32 on CPU, bfloat16 elsewhere)."""
    sizes = target_sizes(target_config)
    check_fits(plan.drafter, plan.config, sizes, plan.spec.source, target_name)
    state = read_weights(plan.folder, plan.spec.source, plan.spec.allow_pickle)
    module = build_head(plan.drafter, plan.config, state, sizes, plan.spec.source)
    wanted = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    module = module.to(device=device, dtype=wanted).eval()
    if device.type == "cpu" and wanted == torch.float32:
        _block_linears(module, plan.spec.source)
    return LoadedHead(drafter=plan.drafter, module=module, taps=plan.taps, source=plan.spec.source)


_FLOAT_INPUTS = ("fc",)  # EAGLE-3's fusion reads the target's raw taps: outliers (block_linear's docstring)


def _block_linears(module: nn.Module, source: str) -> None:
    """The head's linears as Q8_0 through the block kernels (``backend/kernels/block_linear.py``: drafting costs a
    fraction of float32's on CPU); where the kernels cannot run here, it stays float32 and the log says why."""
    try:
        count = block_linear.quantize_linears(module, keep=_FLOAT_INPUTS)
    except blocks.KernelsUnavailable as err:
        log.info("head %s drafts in float32: %s", source, err)
        return
    log.info("head %s: %d linears as Q8_0 through the block kernels", source, count)


def load_head(
    spec: HeadSpec,
    drafter: str | None,
    target_config,
    device: torch.device,
    *,
    target_name: str,
    dtype: torch.dtype | None = None,
    confirm_download: Callable[[int], bool] | None = None,
    progress=None,
) -> LoadedHead:
    """:func:`plan_head` then :func:`load_planned` against a loaded target's config."""
    plan = plan_head(
        spec,
        drafter,
        target_sizes(target_config),
        target_name=target_name,
        confirm_download=confirm_download,
        progress=progress,
    )
    return load_planned(plan, target_config, device, target_name=target_name, dtype=dtype)


def plan_pair_head(
    pair: PairConfig, progress=None, confirm_download: Callable[[int], bool] | None = None
) -> HeadPlan | None:
    """The pair's head found and checked against its target's sizes (models.yaml's), or None: no head, or a
    packaged head this installation lacks (logged; the pair then runs without it, unless its drafter is the
    head's: then :class:`HeadMissing` is raised)."""
    if pair.head is None or not isinstance(pair.target, ModelSpec):
        return None
    target = pair.target
    try:
        return plan_head(
            pair.head,
            pair.drafter if pair.drafter in HEAD_DRAFTERS else None,
            (target.hidden_size, target.num_layers, target.vocab_size),
            target_name=target.source,
            confirm_download=confirm_download,
            progress=progress,
        )
    except HeadMissing as missing:
        if pair.drafter in HEAD_DRAFTERS:
            raise
        log.info("pair %s runs without its head: %s", pair.name, missing)
        return None
