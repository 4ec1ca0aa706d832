"""`specchat add SOURCE [--draft SOURCE] [--name NAME]`: put a model (and its draft) into the user's models.yaml.

Contract: ``run(args) -> int`` with ``args.source``, ``args.draft`` (or None), ``args.name`` (or None: made from
the source), ``args.replace`` and ``args.device``. In order: the device is resolved (a bad one refused); a folder
source must hold a checkpoint; a name that a packaged (or ``--models``) pair has is refused unless ``--replace``
(the user's pair would replace it); the pair is checked as it would be written (sources resolve, sizes read
from the files, ``user_pairs.append_pair`` parses the whole file first); with a draft, both tokenizers are loaded
(a hub source fetches its tokenizer files only, a few MB) and must split text alike (``tokenizer_check``); then the
pair is appended to ``config.user_models_file()`` (atomically, the file's comments and pairs kept) and its memory
estimate on the device is printed, with whether it fits now. Errors (SpecchatError) leave the file untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO


def _progress(message: str, fraction: float | None) -> None:
    done = f" {100 * fraction:.0f}%" if fraction is not None else ""
    print(f"  {message}{done}", file=sys.stderr)


def run(args: Any, out: TextIO | None = None) -> int:
    from specchat.backend.models.catalog.config import (
        PairConfig,
        load_pairs_file,
        packaged_models_file,
        user_models_file,
    )
    from specchat.backend.models.catalog.model_spec import ModelSpec, resolve_source
    from specchat.backend.models.catalog.user_pairs import append_pair, check_folder, default_name
    from specchat.backend.models.facts.memory import estimate_pair, format_bytes, free_memory
    from specchat.backend.models.loading.loaded import resolve_device
    from specchat.backend.paths import expand
    from specchat.backend.redact import terminal_safe

    out = out or sys.stdout
    name = args.name or default_name(args.source)
    file = user_models_file()
    device = resolve_device(getattr(args, "device", None))  # a bad --device is refused before anything is written
    base = expand(args.models) if getattr(args, "models", None) else packaged_models_file()
    taken = {n: str(base) for n in load_pairs_file(base)} if base.is_file() else {}
    for role, source in (("target", args.source), ("draft", args.draft)):
        if source is not None:
            check_folder(source, role)
    if args.draft is not None:
        _check_tokenizers(args.source, args.draft, ModelSpec, resolve_source)
    pair: PairConfig = append_pair(
        file, name, args.source, args.draft, taken=taken, replace_taken=bool(getattr(args, "replace", False))
    )
    replaced = f" (it replaces the pair of that name in {taken[name]})" if name in taken else ""
    print(terminal_safe(f"Added pair '{pair.name}' to {file}{replaced}"), file=out)
    estimate = estimate_pair(pair, device)
    for role, spec in (("target", pair.local_target), ("draft", pair.draft)):
        if spec is None:
            continue
        if spec.sizes_known:
            sizes = f"{_count(spec.params)} params, {spec.num_layers} layers, context up to {spec.context_max or '?'}"
        else:
            sizes = "sizes read once its files are downloaded"
        print(terminal_safe(f"  {role}: {spec.source} ({sizes})"), file=out)
    if estimate.known:
        free = free_memory(device)
        verdict = "fits in" if estimate.total <= free else "does NOT fit in"
        print(
            f"  needs about {format_bytes(estimate.total)} on {device} ({estimate.describe(pair.context_length)}); "
            f"{verdict} the {format_bytes(free)} free now",
            file=out,
        )
    else:
        print("  memory: estimated once the model's files are downloaded (the first start asks first)", file=out)
    print(f"Open it with: specchat --pair {pair.name}", file=out)
    return 0


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _check_tokenizers(target: str, draft: str, model_spec: Any, resolve_source: Any) -> None:
    """Refuse a draft whose tokenizer does not match the target's, before anything is written."""
    from specchat.backend.errors import ConfigError
    from specchat.backend.models.catalog.model_spec import GGUF_KINDS
    from specchat.backend.models.loading.pair import load_tokenizer
    from specchat.backend.models.tokenizing.tokenizer_check import check_tokenizers_compatible

    specs = []
    for source in (target, draft):
        try:
            kind, path = resolve_source(source, base_dir=Path.cwd())
        except ValueError as exc:
            raise ConfigError(f"source {source!r}: {exc}") from None
        specs.append(
            model_spec(
                source=source,
                kind=kind,
                revision=None,
                dtype="auto",
                # A GGUF's tokenizer is read with its metadata only (the int4 path's conversion): no weights
                quantization="int4-torch" if kind in GGUF_KINDS else "none",
                params=0,
                num_layers=0,
                num_kv_heads=0,
                head_dim=0,
                hidden_size=0,
                vocab_size=0,
                download_bytes=0,
                gated=False,
                path=path,
            )
        )
    from specchat.backend.models.hub import hub_gguf

    if any(spec.kind == "hub-gguf" and hub_gguf.cached_path(spec) is None for spec in specs):
        print(
            "The tokenizers are compared at the first start, once the GGUF files are downloaded (before any "
            "weights load).",
            file=sys.stderr,
        )
        return
    print("Checking that the draft's tokenizer matches the target's ...", file=sys.stderr)
    tokenizers = [load_tokenizer(spec, progress=_progress) for spec in specs]
    check_tokenizers_compatible(*tokenizers, target_name=target, draft_name=draft)
