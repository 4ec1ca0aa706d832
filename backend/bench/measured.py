"""What ``specchat bench`` measured, kept per pair so the pair listings can show a pair's expected speed.

Contract:

- :func:`record(aggs, meta)` stores, for each pair of a finished bench run, the decode speed (tokens/s, prefill
  excluded) of every mode it ran, over all prompt families (the ``overall`` aggregate, else the one family), with
  the run's date, device, threads and the target's source, in ``paths.cache_dir()/bench/measured.json`` (written
  atomically; the newest run of a pair replaces its older one).
- :func:`expected_speed(pair_name, source)` is one line for a listing: the plain speed and the fastest speculative
  mode's, e.g. ``18.2 tok/s plain, 31.5 with suffix (bench 2025-06-01, cpu, 2 threads)``; ``not measured (specchat
  bench --pair NAME)`` where no run of this pair with this target is recorded. Nothing here imports torch.
- :func:`expected_slower(pair, device)` says why a pair is expected to be slower than plain decoding on this
  device, or None: measured (its fastest speculative mode ran below plain in the bench), else known (a
  bitsandbytes draft on CPU de-quantises all its weights at every draft step: several times the target's
  cost: ``benchmarks/RESULTS.md``, "Figures moved out of the code").
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specchat.backend.files import write_atomic
from specchat.backend.paths import cache_dir

OVERALL = "overall"
_PLAIN = "plain"


def store_file() -> Path:
    return cache_dir() / "bench" / "measured.json"


def _read() -> dict[str, Any]:
    try:
        data = json.loads(store_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(aggs: Iterable[Any], meta: dict[str, Any], sources: dict[str, str]) -> None:
    """Store the decode speeds of ``aggs`` (``bench.stats.Aggregate``) per pair; ``sources``: pair -> target
    source. An unwritable cache is skipped silently: the bench's own files hold the results."""
    by_pair: dict[str, dict[str, dict[str, float]]] = {}
    for agg in aggs:
        if agg.decode_tok_s is None or agg.mode.startswith(("hf-", "llamacpp")):
            continue  # only specchat's own modes: a listing shows what specchat will do
        by_pair.setdefault(agg.pair, {}).setdefault(agg.family, {})[agg.mode] = round(float(agg.decode_tok_s), 2)
    if not by_pair:
        return
    data = _read()
    for pair, families in by_pair.items():
        modes = families.get(OVERALL) or next(iter(families.values()))
        data[pair] = {
            "source": sources.get(pair, ""),
            "decode_tok_s": modes,
            "date": time.strftime("%Y-%m-%d"),
            "device": str(meta.get("device") or meta.get("torch_device") or "cpu"),
            "threads": meta.get("threads") or meta.get("torch_threads"),
        }
    try:
        store_file().parent.mkdir(parents=True, exist_ok=True)
        write_atomic(store_file(), json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass


def read_measured() -> dict[str, Any]:
    """Every pair's stored speeds, for :func:`expected_speed`'s ``measured`` (a listing reads the file once)."""
    return _read()


def expected_speed(pair_name: str, source: str, measured: dict[str, Any] | None = None) -> str:
    """See the module docstring; ``measured``: :func:`read_measured`'s, else the file is read now."""
    entry = (_read() if measured is None else measured).get(pair_name)
    hint = f"not measured (specchat bench --pair {pair_name})"
    if not isinstance(entry, dict) or entry.get("source") != source:
        return hint
    modes = entry.get("decode_tok_s")
    if not isinstance(modes, dict) or not modes:
        return hint
    parts = []
    plain = modes.get(_PLAIN)
    if isinstance(plain, (int, float)):
        parts.append(f"{plain:.1f} tok/s plain")
    others = {m: v for m, v in modes.items() if m != _PLAIN and isinstance(v, (int, float))}
    if others:
        mode, speed = max(others.items(), key=lambda item: item[1])
        parts.append(f"{speed:.1f} with {mode}" if parts else f"{speed:.1f} tok/s with {mode}")
    if not parts:
        return hint
    threads = entry.get("threads")
    where = ", ".join(str(x) for x in (entry.get("date"), entry.get("device"), threads and f"{threads} threads") if x)
    return f"{', '.join(parts)} (bench {where})"


BNB_QUANTIZATIONS = ("nf4", "int8")  # bitsandbytes: on CPU, weights de-quantised at each call


def expected_slower(pair: Any, device: str) -> str | None:
    """See the module docstring; ``pair`` is a ``PairConfig`` (its name, drafter, draft and local target)."""
    entry = _read().get(pair.name)
    entry = entry if isinstance(entry, dict) else {}
    modes = entry.get("decode_tok_s")
    if isinstance(modes, dict) and entry.get("source") == pair.local_target.source:
        plain = modes.get(_PLAIN)
        others = [v for m, v in modes.items() if m != _PLAIN and isinstance(v, (int, float))]
        if isinstance(plain, (int, float)) and others and max(others) < plain:
            return f"slower than plain decoding here: {max(others):.1f} against {plain:.1f} tok/s plain in the bench"
        if isinstance(plain, (int, float)) and others:
            return None  # measured, and speculation paid
    draft = pair.draft if pair.drafter == "draft-model" else None
    if device.startswith("cpu") and draft is not None and draft.quantization in BNB_QUANTIZATIONS:
        return (
            f"expected slower than plain decoding on CPU: its {draft.quantization} draft (bitsandbytes) "
            "de-quantises every weight at each draft step, and quantising it takes ~30 s at load"
        )
    return None
