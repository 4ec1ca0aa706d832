"""`specchat models`: list the pairs of models.yaml (plus the user's file) with what a user needs to choose one.

Contract: ``run(args) -> int`` with ``args.models`` (a file or None), ``args.device`` (or None: cuda when
available, else cpu) and ``args.pair`` (None: every pair; a name: only that pair, ConfigError when unknown).
Prints, per pair: name (``*`` marks the default), target, drafter (and draft model), where the weights come
from, the estimated memory on the device, whether it fits in the free memory now, what is left to download,
and whether the hub repo is gated; then each pair's description. Works offline: the estimate uses
models.yaml's numbers and the download column only looks at the local Hugging Face cache. A remote pair (its
target is a server) has no memory estimate: its FITS column says whether the server answers ``GET /models``
now and lists the pair's model ("up", "DOWN", "no model"; one short request per remote pair, the only network
use), and each problem is printed under the table.
User errors (bad file, unknown pair, bad device) propagate as SpecchatError; the CLI prints them on one line
and exits with 2.
"""

from __future__ import annotations

import sys
import textwrap
from typing import Any, TextIO


def _drafter(pair: Any) -> str:
    if pair.drafter != "draft-model" or pair.draft is None:
        return pair.drafter
    quant = f" {pair.draft.quantization}" if pair.draft.quantization != "none" else ""
    return f"draft {pair.draft.source}{quant}"


def _origin(pair: Any) -> str:
    kinds = [pair.target.kind] + ([pair.draft.kind] if pair.draft is not None else [])
    return "+".join(dict.fromkeys(kinds))  # de-duplicated, in order


def _download(pair: Any, is_cached: Any, format_bytes: Any) -> str:
    specs = {(s.source, s.revision): s for s in (pair.target, pair.draft) if s is not None and s.kind == "hub"}
    if not specs:
        return "none"
    missing = [s for s in specs.values() if not is_cached(s)]
    if not missing:
        return "cached"
    total = sum(s.download_bytes for s in missing)
    return format_bytes(total) if total else "unknown"


def _remote_row(pair: Any, default: str, problems: list[str]) -> list[str]:
    from specchat.backend.remote.client import check_server

    check = check_server(pair.remote, pair.name)
    if check["error"]:
        problems.append(f"{pair.name}: {check['error']}")
    state = "DOWN" if not check["reachable"] else "no model" if check["model_listed"] is False else "up"
    return [
        "*" if pair.name == default else "",
        pair.name,
        pair.target.source,
        "server",
        f"remote {pair.remote.server_kind}",
        "-",
        state,
        "none",
        "-",
    ]


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)


def run(args: Any, out: TextIO | None = None) -> int:
    """Print the pair listing; returns 0 (errors raise SpecchatError)."""
    from specchat.backend.models.config import default_pair_name, get_pair, load_pairs, user_models_file
    from specchat.backend.models.hub import is_cached
    from specchat.backend.models.loading import resolve_device
    from specchat.backend.models.memory import estimate_pair, format_bytes, free_memory

    out = out or sys.stdout
    pairs = load_pairs(getattr(args, "models", None))
    default = default_pair_name(pairs)
    name = getattr(args, "pair", None)
    shown = [get_pair(pairs, name)] if name else list(pairs.values())
    device = resolve_device(getattr(args, "device", None))
    free = free_memory(device)

    files = sorted({p.source_file for p in pairs.values()})
    user = user_models_file()
    note = "" if user.is_file() else f" (user additions: {user})"
    print(f"Model pairs from {', '.join(files)}{note}", file=out)
    print(f"Device {device}: {format_bytes(free)} free. * = default pair.", file=out)
    print(file=out)
    rows = [["", "NAME", "TARGET", "DRAFTER", "FROM", "MEMORY", "FITS", "DOWNLOAD", "GATED"]]
    problems: list[str] = []
    for pair in shown:
        if pair.remote is not None:
            rows.append(_remote_row(pair, default, problems))
            continue
        estimate = estimate_pair(pair, device)
        target = pair.local_target
        gated = any(s is not None and getattr(s, "gated", False) for s in (target, pair.draft))
        quant = f" {target.quantization}" if target.quantization != "none" else ""
        rows.append(
            [
                "*" if pair.name == default else "",
                pair.name,
                pair.target.source + quant,
                _drafter(pair),
                _origin(pair),
                format_bytes(estimate.total),
                "yes" if estimate.total <= free else "no",
                _download(pair, is_cached, format_bytes),
                "yes" if gated else "no",
            ]
        )
    _table(rows, out)
    for problem in problems:
        print(f"  ! {problem}", file=out)
    print(file=out)
    for pair in shown:
        text = pair.description or "(no description)"
        print(textwrap.fill(text, width=100, initial_indent=f"  {pair.name}: ", subsequent_indent="    "), file=out)
    if any(s is not None and getattr(s, "gated", False) for p in shown for s in (p.target, p.draft)):
        print(
            "\nGated: accept the licence on huggingface.co, then log in with `hf auth login` "
            "(older huggingface_hub: `huggingface-cli login`).",
            file=out,
        )
    print(
        f"\nMemory: weights + KV caches for each pair's context_length + scratch + 8% headroom, on {device}. "
        "Use --pair NAME to choose one.",
        file=out,
    )
    return 0
