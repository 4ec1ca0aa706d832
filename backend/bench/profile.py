"""`specchat bench --profile`: where a decoding step's time goes, on a loaded engine.

Contract: :func:`profile_engine(engine, messages, drafter, max_new_tokens)` generates one greedy reply (after a
warm-up reply) and returns a :class:`StepProfile` of its decoding steps (the prompt's pass left out): per step,
the time in the native model's C++ pass split by its counters (``csrc/model_forward.cpp``: weight kernels,
attention with its K/V writes, norms / rotary / other elementwise steps; on for this reply only, two clock reads
per part when on, nothing when off), the rest of the target's forward calls (Python and argument passing around
the pass), and the rest of the step in Python (sampling, drafting, verification, detokenising, the engine's
bookkeeping). On a path without the native model the forward is one part. :func:`table(profile)` formats it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.limits import DrafterName

PARTS = (
    ("kernels", "weight kernels (projections, head, embedding rows)"),
    ("attention", "attention (and its K/V writes)"),
    ("elementwise", "norms, rotary, activations, residuals"),
    ("forward_other", "the forward's Python and call overhead"),
    ("rest", "sampling, drafting, verifying, detokenising"),
)


@dataclass
class StepProfile:
    pair: str
    path: str
    drafter: str
    threads: int = 0
    steps: int = 0
    tokens: int = 0
    rows: int = 0  # rows the target's passes held (tokens verified + pending)
    wall_s: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)  # part -> seconds over the whole reply


def profile_engine(
    engine, messages: list[dict[str, str]], drafter: DrafterName = "none", max_new_tokens: int = 64
) -> StepProfile:
    """See the module docstring."""
    runner = engine.runner
    native = runner.native
    request = GenerationRequest(
        messages=messages,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0),
        drafter=drafter,
        gamma=None if drafter == "none" else "auto",
    )
    for _ in engine.generate(request):  # warm-up: the same reply once, nothing counted
        pass
    spent = {"forward": 0.0}
    forward = runner.forward

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent["forward"] += time.perf_counter() - started

    profile = StepProfile(engine.pair.name, engine.start_line, drafter, threads=torch.get_num_threads())
    runner.forward = timed
    if native is not None:
        native.set_profiling(True)
    started = time.perf_counter()
    try:
        for event in engine.generate(request):
            if event.is_prefill:  # decoding steps only: the counters start after the prompt's pass
                spent["forward"] = 0.0
                if native is not None:
                    native.reset_profile()
                started = time.perf_counter()
                continue
            profile.steps += 1
            profile.tokens += len(event.token_ids)
    finally:
        profile.wall_s = time.perf_counter() - started
        del runner.forward  # the bound method again
        if native is not None:
            native.set_profiling(False)
    counted = native.profile() if native is not None else {}
    inside = sum(counted.get(part, 0.0) for part in ("kernels", "attention", "elementwise"))
    profile.rows = int(counted.get("rows", 0))
    profile.seconds = {
        "kernels": counted.get("kernels", 0.0),
        "attention": counted.get("attention", 0.0),
        "elementwise": counted.get("elementwise", 0.0),
        "forward_other": spent["forward"] - inside,
        "rest": profile.wall_s - spent["forward"],
    }
    return profile


def table(profile: StepProfile) -> str:
    """The profile as lines of text: milliseconds a step and share of the step, per part."""
    steps = max(profile.steps, 1)
    total = max(profile.wall_s, 1e-12)
    rate = profile.tokens / total
    lines = [
        f"{profile.pair} on {profile.path}; drafter {profile.drafter}: {profile.tokens} tokens in {profile.steps} "
        f"steps ({profile.rows / steps:.1f} rows a pass), {rate:.1f} tok/s, {profile.threads} threads",
        f"  {'part':<46} {'ms/step':>8} {'share':>6}",
    ]
    for key, label in PARTS:
        seconds = profile.seconds.get(key, 0.0)
        lines.append(f"  {label:<46} {seconds / steps * 1e3:8.2f} {seconds / total:6.0%}")
    lines.append(f"  {'whole step':<46} {total / steps * 1e3:8.2f} {1:6.0%}")
    return "\n".join(lines)
