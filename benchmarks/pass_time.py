"""Where a decoding pass of the int4 default goes: its time with PyTorch's int4/int8 kernels, and with them
stubbed out (same output shapes, no arithmetic), so the difference is the kernels and the rest is the compact
forward's own operations (norms, rotary, attention, casts) and Python.

Measures one-token and 8-token passes after a prompt of ``--context`` random tokens, the minimum over rounds
of ``--reps`` passes; measure on a quiet machine. It also times the kernels alone: the same calls a one-token
pass makes (every layer's projections and the head, on the real weights) back to back with nothing between
them, the floor the compact forward's own operations sit on. With the native decoder layers built
(``backend/kernels/native.py``) the passes above are theirs, and the same passes through the Python loop are
timed too for the ratio; the stubbed passes are always the Python loop's.

    python benchmarks/pass_time.py [--context 300] [--rows 1 8] [--pair smollm2-135m]
"""

from __future__ import annotations

import argparse
import time

import torch

from specchat.backend.engine.engine import load_engine
from specchat.backend.kernels import native
from specchat.backend.kernels.compact import CompactForward
from specchat.backend.models.config import load_pairs


def _time(runner, seq, ids: list[int], rows: int, reps: int, rounds: int = 5) -> float:
    for _ in range(3):
        runner.forward(seq, ids[:rows], logits_to_keep=rows)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            runner.forward(seq, ids[:rows], logits_to_keep=rows)
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def _kernels_alone(forward: CompactForward, rounds: int = 5, reps: int = 10) -> float:
    """Milliseconds for one token's kernel calls, back to back (the minimum over ``rounds`` of ``reps``)."""
    calls = []
    for layer in forward.layers:
        for name, call in layer.run.items():
            if name in ("q", "k", "v") and "qkv" in layer.run or name in ("gate", "up") and "gate_up" in layer.run:
                continue  # a one-token pass calls the joined projection, not its parts
            calls.append((call, torch.randn(1, getattr(layer, name).in_features, dtype=torch.bfloat16)))
    calls.append((forward.run_head, torch.randn(1, forward.hidden)))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(reps):
                for call, x in calls:
                    call(x)
            best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def _stub_kernels(forward: CompactForward) -> None:
    outputs: dict[tuple[int, int], torch.Tensor] = {}

    def stub(width: int):
        def call(x: torch.Tensor) -> torch.Tensor:
            key = (x.shape[0], width)
            if key not in outputs:
                outputs[key] = torch.zeros(key, dtype=torch.bfloat16)
            return outputs[key]
        return call

    for layer in forward.layers:
        for name in list(layer.run):
            module = getattr(layer, name)
            layer.run[name] = stub(module.out_features)
    forward.run_head = stub(forward.head.out_features)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    engine = load_engine(load_pairs()[args.pair])
    runner = engine.runner
    forward = getattr(runner, "compact", None)
    if not isinstance(forward, CompactForward):
        raise SystemExit(f"{args.pair} does not run the compact forward here ({runner.path}); nothing to measure")
    ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = runner.cache.new_sequence()
    runner.forward(seq, ids)
    seq.commit(len(ids))
    if runner.native is not None:
        runner.native.wait()
        runner.adopt_native()  # as the engine does between requests
    native_layers = forward.native
    loop: dict[int, float] = {}
    native: dict[int, float] = {}
    for rows in args.rows:  # native and Python-loop rounds alternate, so drift hits both alike
        reps = max(3, 20 // rows)
        if native_layers is None:
            loop[rows] = _time(runner, seq, ids, rows, reps)
            continue
        loop[rows] = native[rows] = float("inf")
        for _ in range(5):
            forward.native = None
            loop[rows] = min(loop[rows], _time(runner, seq, ids, rows, reps, rounds=1))
            forward.native = native_layers
            native[rows] = min(native[rows], _time(runner, seq, ids, rows, reps, rounds=1))
    forward.native = None  # the stubbed kernels below are the Python loop's calls
    alone = _kernels_alone(forward)
    _stub_kernels(forward)
    stubbed = {rows: _time(runner, seq, ids, rows, reps=max(3, 20 // rows)) for rows in args.rows}
    for rows in args.rows:
        print(f"{rows} row(s) at {args.context} tokens of context, Python loop: {loop[rows]:.1f} ms a pass, "
              f"{stubbed[rows]:.1f} ms with the int4/int8 kernels stubbed out "
              f"({loop[rows] - stubbed[rows]:.1f} ms of kernels)")
        if rows in native:
            print(f"{rows} row(s) through the native layers: {native[rows]:.1f} ms a pass, "
                  f"{native[rows] / loop[rows]:.3f}x the Python loop's")
    print(f"the kernels alone, one token's calls back to back: {alone:.1f} ms")
    if native_layers is None:
        why = (runner.native.reason if runner.native is not None
               else native.bindable(forward) or "switched off (SPECCHAT_NATIVE=0)")
        print(f"no native layers: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
