"""`specchat bench --kernels`: what a pass over 1, 4, 16 and 64 rows costs in the GGUF block kernels
(backend/kernels/blocks.py), per weight type, beside the memory-read bound and PyTorch's int4 kernel.

Contract: :func:`measure(threads, rounds, progress) -> dict` builds random weights of every type on two
workloads (one 8192×2048 matrix; the seven matrices of a ~1B llama layer: hidden 2048, intermediate 5632, KV
256) and times ``QWeight.time_matmul`` (the kernel called back to back from C++, no Python around it) at each
row count, the row counts interleaved within each of ``rounds`` rounds, the median kept. Per type and
workload: ms per pass at each row count and its ratio to the 1-row pass, the GGUF bytes read per pass, GB/s at
one row and its fraction of the measured read bandwidth (a 256 MiB ``x.sum()``: no kernel reads weights
faster). PyTorch's ``_weight_int4pack_mm_for_cpu`` (int4, group 32, bfloat16 activations, timed from Python)
runs the same shapes for reference. :func:`format_tables` prints it; :func:`run_kernels` is the command body
(also writes ``kernels.json`` to ``--out``).
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROWS = (1, 4, 16, 64)
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")
# (name, N outputs, K inputs)
WORKLOADS: dict[str, list[tuple[str, int, int]]] = {
    "8192x2048": [("w", 8192, 2048)],
    "1B llama layer": [
        ("q", 2048, 2048),
        ("k", 256, 2048),
        ("v", 256, 2048),
        ("o", 2048, 2048),
        ("gate", 5632, 2048),
        ("up", 5632, 2048),
        ("down", 2048, 5632),
    ],
}
TARGET_S = 0.02  # seconds each timed batch of calls lasts (after the first call sets its size)
TORCH_INT4 = "torch int4 g32"


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and the flags that decide the kernels' path (from /proc/cpuinfo where present)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def _repeats(seconds: float) -> int:
    return max(1, min(10_000, int(TARGET_S / max(seconds, 1e-7))))


def _time_type(type_name: str, shapes, xs: dict[int, dict[int, torch.Tensor]], rounds: int) -> dict[str, Any]:
    from specchat.backend.kernels import blocks

    rng = np.random.default_rng(0)
    weights, nbytes = [], 0
    for _, n, k in shapes:
        data = blocks.random_blocks(type_name, n, k, rng)
        nbytes += data.nbytes
        weights.append((blocks.qweight(data, type_name, n, k), k))
        del data  # the QWeight holds its repacked copy only
    repeats = {}
    for m in ROWS:
        first = sum(w.time_matmul(xs[k][m], 1) for w, k in weights)
        repeats[m] = _repeats(first / len(weights))
    samples: dict[int, list[float]] = {m: [] for m in ROWS}
    for _ in range(rounds):
        for m in ROWS:
            samples[m].append(sum(w.time_matmul(xs[k][m], repeats[m]) for w, k in weights))
    return _summary(nbytes, {m: statistics.median(v) for m, v in samples.items()})


def _time_torch_int4(shapes, xs: dict[int, dict[int, torch.Tensor]], rounds: int) -> dict[str, Any]:
    from specchat.backend.kernels.int4_layout import pack_cpu

    gen = torch.Generator().manual_seed(0)
    op = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    weights, nbytes = [], 0
    for _, n, k in shapes:
        packed = pack_cpu(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen))
        sz = (torch.rand(k // 32, n, 2, generator=gen) * 0.01).to(torch.bfloat16)
        nbytes += packed.numel() * packed.element_size() + sz.numel() * sz.element_size()
        weights.append((packed, sz, k))
    bf = {k: {m: x.to(torch.bfloat16) for m, x in per.items()} for k, per in xs.items()}

    def once(m: int, repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            for packed, sz, k in weights:
                op(bf[k][m], packed, 32, sz)
        return (time.perf_counter() - start) / repeats

    repeats = {m: _repeats(once(m, 1)) for m in ROWS}
    samples: dict[int, list[float]] = {m: [] for m in ROWS}
    for _ in range(rounds):
        for m in ROWS:
            samples[m].append(once(m, repeats[m]))
    return _summary(nbytes, {m: statistics.median(v) for m, v in samples.items()})


def _summary(nbytes: int, seconds: dict[int, float]) -> dict[str, Any]:
    return {
        "bytes": nbytes,
        "ms": {str(m): s * 1e3 for m, s in seconds.items()},
        "x_one_row": {str(m): s / seconds[1] for m, s in seconds.items()},
        "GBps_one_row": nbytes / seconds[1] / 1e9,
    }


def measure(threads: int, rounds: int = 5, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every type on every workload (module docstring); ``threads`` torch threads for the kernels and torch."""
    from specchat.backend.bench.synthetic import read_bandwidth
    from specchat.backend.kernels import blocks

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        blocks.load()
        bandwidth = read_bandwidth(torch.device("cpu"), 256 * 2**20)
        result: dict[str, Any] = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpu": cpu_description(),
            "kernel_isa": blocks.kernel_isa(),
            "threads": threads,
            "torch": torch.__version__,
            "rounds": rounds,
            "read_bandwidth_GBps": bandwidth / 1e9,
            "workloads": {},
        }
        gen = torch.Generator().manual_seed(1)
        for name, shapes in WORKLOADS.items():
            ks = {k for _, _, k in shapes}
            xs = {k: {m: torch.randn(m, k, generator=gen) for m in ROWS} for k in ks}
            table: dict[str, Any] = {}
            for type_name in TYPES:
                progress(f"{name}: {type_name}")
                table[type_name] = _time_type(type_name, shapes, xs, rounds)
            progress(f"{name}: {TORCH_INT4}")
            table[TORCH_INT4] = _time_torch_int4(shapes, xs, rounds)
            for row in table.values():
                row["of_bound"] = row["GBps_one_row"] / (bandwidth / 1e9)
            result["workloads"][name] = {"shapes": [list(s) for s in shapes], "types": table}
        return result
    finally:
        torch.set_num_threads(before)


def format_tables(r: dict[str, Any]) -> str:
    cpu = r["cpu"]
    lines = [
        f"specchat bench --kernels  {r['date']}  {cpu['model']} ({' '.join(cpu['flags'])})",
        f"  kernels: {r['kernel_isa']}, threads {r['threads']}, torch {r['torch']}, median of {r['rounds']} "
        f"interleaved rounds; read bandwidth (x.sum, 256 MiB) {r['read_bandwidth_GBps']:.1f} GB/s",
    ]
    for name, workload in r["workloads"].items():
        shapes = ", ".join(f"{s[0]} {s[1]}x{s[2]}" for s in workload["shapes"])
        lines += ["", f"{name} ({shapes}): ms per pass (x the 1-row pass)"]
        lines.append(f"  {'type':<16}{'MB':>7}{'GB/s@1':>8}{'bound':>7}" + "".join(f"{f'{m} rows':>17}" for m in ROWS))
        for type_name, row in workload["types"].items():
            cells = "".join(f"{row['ms'][str(m)]:>9.3f} ({row['x_one_row'][str(m)]:>4.1f}x)" for m in ROWS)
            lines.append(
                f"  {type_name:<16}{row['bytes'] / 1e6:>7.1f}{row['GBps_one_row']:>8.1f}{row['of_bound']:>7.0%}{cells}"
            )
    lines.append(f"  ({TORCH_INT4}: bfloat16 activations, timed from Python; the others from C++)")
    return "\n".join(lines)


def run_kernels(args) -> int:
    """The ``specchat bench --kernels`` command body: measure, print, write ``<out>/kernels.json``."""
    threads = getattr(args, "threads", None) or torch.get_num_threads()
    result = measure(threads, progress=lambda m: print(m, flush=True))
    print(format_tables(result))
    out_dir = Path(getattr(args, "out", None) or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "kernels.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0
