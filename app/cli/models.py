"""`specchat models`: list the pairs of models.yaml (plus the user's file) with what a user needs to choose one.

Contract: ``run(args) -> int`` with ``args.models`` (a file or None), ``args.device`` (or None: cuda when
available, else cpu) and ``args.pair`` (None: every pair; a name: only that pair, ConfigError when unknown).
Prints one block per pair, folded to the terminal's width (80 columns and up; ``COLUMNS`` is honoured): a head line
(``*`` marks the default pair) with the estimated memory on the device, whether it fits in the free memory now and
what is left to download; then the description; the target (and draft) with its source, its sizes and where each
number came from (``file``: read from the model's files; ``models.yaml``: an override written there; ``unknown``:
a hub model not downloaded yet), the types its weights are stored in and the context; the memory estimate's terms
and how the weights were counted (as stored in the file, re-quantised, or as floats); the drafter; and the expected
speed from the bench's measurements (``bench.measured``), or "not measured". Works offline: the numbers
come from local files and the download column only looks at the local Hugging Face cache. A remote pair (its
target is a server) has no memory estimate: its head line says whether the server answers ``GET /models`` now and
lists the pair's model ("up", "DOWN", "no model"; one short request per remote pair, the only network use).
User errors (bad file, unknown pair, bad device) propagate as SpecchatError; the CLI prints them on one line
and exits with 2.
"""

from __future__ import annotations

import glob
import shutil
import sys
import textwrap
from typing import Any, TextIO

_LABEL = 10  # width of the "target", "draft", ... labels


def _width(out: TextIO) -> int:
    columns = shutil.get_terminal_size((80, 24)).columns if out in (sys.stdout, sys.__stdout__) else 80
    return max(60, min(columns, 120))


def _fold(label: str, text: str, width: int) -> list[str]:
    """``text`` under a left label, folded at spaces (long words such as paths broken where they must be); the
    text of models.yaml, a model's files or a server, so stripped of terminal escapes first."""
    from specchat.backend.redact import terminal_safe

    lead = f"    {label:<{_LABEL}}"
    return textwrap.wrap(
        terminal_safe(text), width=width, initial_indent=lead, subsequent_indent=" " * len(lead), break_on_hyphens=False
    ) or [lead.rstrip()]


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _origin(spec: Any) -> str:
    origins = dict(spec.origins)
    kinds = set(origins.values()) or {"models.yaml"}
    if kinds == {"file"}:
        return "all from the file"
    if kinds == {"override"} or not origins:
        return "all from models.yaml"
    if kinds == {"unknown"}:
        return ""
    named = [f"{name} {'from models.yaml' if kind == 'override' else kind}" for name, kind in origins.items()]
    return "; ".join(named)


def _model_lines(label: str, spec: Any, context: int | None, width: int, device: Any) -> list[str]:
    from specchat.backend.models.facts import forward_path
    from specchat.backend.models.facts.memory import as_stored

    # The quantization field names what the fallback path does; where the native model runs it, it is not in play.
    quant = f", quantization {spec.quantization}" if spec.quantization != "none" and not as_stored(spec, device) else ""
    lines = _fold(label, f"{spec.source}{quant}", width)
    lines += _fold("runs", forward_path.describe(spec, device), width)
    if not spec.sizes_known and set(dict(spec.origins).values()) == {"unknown"}:
        lines += _fold("", "sizes: unknown until its files are downloaded (read from them then)", width)
        return lines
    arch = f"{spec.architecture}: " if spec.architecture else ""
    sizes = (
        f"{arch}{_count(spec.params)} params, {spec.num_layers} layers, {spec.num_kv_heads} KV heads x "
        f"{spec.head_dim}, hidden {spec.hidden_size}, vocab {spec.vocab_size}"
    )
    where = _origin(spec)
    lines += _fold("", sizes + (f" ({where})" if where else ""), width)
    details = []
    types = ", ".join(f"{name} {100 * size / spec.weight_bytes:.0f}%" for name, size in _ranked(spec))
    if types:
        details.append(f"stored as {types}")
    if context is not None:
        stated = f" of the {spec.context_max} it states" if spec.context_max else ""
        details.append(f"context {context}{stated}")
    if spec.chat_template is False:
        details.append("no chat template: plain completion")
    if details:
        lines += _fold("", "; ".join(details), width)
    return lines


def _ranked(spec: Any) -> list[tuple[str, int]]:
    total = spec.weight_bytes or 1
    ranked = sorted(spec.weight_types, key=lambda item: -item[1])
    return [(name, size) for name, size in ranked if size * 200 >= total]


def _download(pair: Any, is_cached: Any, format_bytes: Any) -> str:
    specs = {
        (s.source, s.revision): s for s in (pair.target, pair.draft) if s is not None and s.kind in ("hub", "hub-gguf")
    }
    if not specs:
        return "download none"
    missing = [s for s in specs.values() if not is_cached(s)]
    if not missing:
        return "cached"
    total = sum(s.download_bytes for s in missing)
    return f"download {format_bytes(total)}" if total else "download (size unknown)"


def _cached(spec: Any) -> bool:
    from specchat.backend.models.hub import hub_gguf
    from specchat.backend.models.hub import repos as hub

    return hub_gguf.cached_path(spec) is not None if spec.kind == "hub-gguf" else hub.is_cached(spec)


def _remote_block(pair: Any, default: str, width: int) -> list[str]:
    from specchat.backend.remote.client import check_server

    check = check_server(pair.remote, pair.name)
    state = "DOWN" if not check["reachable"] else "no model" if check["model_listed"] is False else "up"
    lines = [f"{'*' if pair.name == default else ' '} {pair.name}   server {state}"]
    lines += _fold("target", f"{pair.target.source} ({pair.remote.server_kind})", width)
    if check["error"]:
        lines += _fold("problem", check["error"], width)
    return lines


def _pair_block(pair: Any, default: str, device: Any, free: int, width: int, measured: dict) -> list[str]:
    from specchat.backend.bench.measured import expected_speed
    from specchat.backend.models.facts.memory import estimate_pair, format_bytes, weights_basis

    estimate = estimate_pair(pair, device)
    target = pair.local_target
    if estimate.known:
        memory = f"{format_bytes(estimate.total)}, {'fits' if estimate.total <= free else 'does NOT fit'}"
    else:
        memory = "memory known after the download"
    head = f"{'*' if pair.name == default else ' '} {pair.name}   {memory}, {_download(pair, _cached, format_bytes)}"
    lines = textwrap.wrap(head, width=width, subsequent_indent="    ")
    if pair.description:
        lines += _fold("", pair.description, width)
    lines += _model_lines("target", target, pair.context_length, width, device)
    draft = pair.draft if pair.drafter == "draft-model" else None
    if draft is not None:
        lines += _model_lines("draft", draft, None, width, device)
    if estimate.known:
        basis = f"weights: target {weights_basis(target, device)}"
        basis += f"; draft {weights_basis(draft, device)}" if draft is not None else ""
        whole = f"; the whole process about {format_bytes(estimate.process)}" if estimate.runtime else ""
        lines += _fold("memory", f"{estimate.describe(pair.context_length)}{whole} ({basis})", width)
    lines += _fold("drafter", f"{pair.drafter}, gamma {pair.gamma}", width)
    lines += _fold("speed", expected_speed(pair.name, target.source, measured), width)
    if any(s is not None and s.gated for s in (target, pair.draft)):
        lines += _fold("gated", "accept the licence on huggingface.co, then run `hf auth login`", width)
    return lines


def _device(name: str | None) -> Any:
    """The device to estimate for: "cpu" without importing torch (most of a listing's time: RESULTS.md) when asked
    for, or when no GPU device node exists (so torch could find no CUDA device); else torch decides (cuda when
    available)."""
    if name == "cpu" or (name in (None, "auto") and not any(glob.glob(pattern) for pattern in GPU_NODES)):
        return "cpu"
    from specchat.backend.models.loading.loaded import resolve_device

    return resolve_device(name)


GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")  # NVIDIA, ROCm, WSL's GPU


def run(args: Any, out: TextIO | None = None) -> int:
    """Print the pair listing; returns 0 (errors raise SpecchatError)."""
    from specchat.backend.bench.measured import read_measured
    from specchat.backend.models.catalog.config import default_pair_name, get_pair, load_pairs, user_models_file
    from specchat.backend.models.facts.memory import format_bytes, free_memory
    from specchat.backend.redact import terminal_safe

    out = out or sys.stdout
    width = _width(out)
    pairs = load_pairs(getattr(args, "models", None))
    default = default_pair_name(pairs)
    name = getattr(args, "pair", None)
    shown = [get_pair(pairs, name)] if name else list(pairs.values())
    device = _device(getattr(args, "device", None))
    free = free_memory(device)
    measured = read_measured()

    files = sorted({p.source_file for p in pairs.values()})
    user = user_models_file()
    note = "" if user.is_file() else f"; add your own with `specchat add SOURCE` (written to {user})"
    for line in textwrap.wrap(f"Model pairs from {', '.join(files)}{note}", width=width, subsequent_indent="  "):
        print(terminal_safe(line), file=out)
    print(f"Device {device}: {format_bytes(free)} free. * = default pair.", file=out)
    for pair in shown:
        print(file=out)
        block = (
            _remote_block(pair, default, width)
            if pair.remote is not None
            else _pair_block(pair, default, device, free, width, measured)
        )
        for line in block:
            print(terminal_safe(line), file=out)  # every line: a value of a file or a server never acts on the terminal
    print(file=out)
    legend = (
        f"Memory: weights + KV caches for each pair's context + scratch + 8% headroom, on {device}. Sizes say where "
        "they came from: the model's files, or models.yaml (an override, checked against the files). "
        "Open one with `specchat --pair NAME`."
    )
    for line in textwrap.wrap(legend, width=width):
        print(line, file=out)
    return 0
