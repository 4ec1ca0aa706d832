"""metrics.py: the --json "stats" object (fields, definitions, null not NaN) from a scripted request with a fake
clock, the live snapshot and its sliding tok/s window."""

from __future__ import annotations

import json
import math

import pytest

from specchat.backend.spec.policy import expected_tokens
from specchat.backend.spec.stats import SpecStats

FIELDS = {
    "new_tokens", "wall_s", "prefill_s", "ttft_s", "prefill_tokens", "tok_s", "steps", "spec_paused_steps",
    "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "per_position_acceptance", "gamma",
}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def scripted() -> tuple[SpecStats, Clock]:
    """prefill 20 tokens in 0.5 s (1 token), then: γ=3 all accepted, γ=3 reject at 1, γ=2 reject at 0,
    a paused plain step, a plain step with no draft; 0.1 s a step."""
    clock = Clock()
    stats = SpecStats(clock=clock)
    clock.t += 0.5
    stats.observe_prefill(tokens=20, seconds=0.5)
    for gamma, accepted, paused in [(3, 3, False), (3, 1, False), (2, 0, False), (0, 0, True), (0, 0, False)]:
        clock.t += 0.1
        stats.observe_step(gamma=gamma, accepted=accepted, emitted=accepted + 1, paused=paused,
                           draft_s=0.01 * gamma, verify_s=0.08, overhead_s=0.01)
    return stats, clock


def test_stats_object_fields_and_values() -> None:
    stats, _ = scripted()
    out = stats.to_dict()
    assert set(out) == FIELDS
    assert out["new_tokens"] == 1 + 4 + 2 + 1 + 1 + 1
    assert out["wall_s"] == pytest.approx(1.0) and out["ttft_s"] == pytest.approx(0.5)
    assert out["prefill_s"] == 0.5 and out["prefill_tokens"] == 20
    assert out["tok_s"] == pytest.approx(10.0)
    assert out["steps"] == 5 and out["spec_paused_steps"] == 1
    assert out["drafted"] == 8 and out["accepted"] == 4
    assert out["acceptance_rate"] == 0.5
    assert out["mean_accepted_length"] == pytest.approx(1 + 4 / 3, abs=1e-4)  # over the 3 speculating steps
    # position 0: reached 3 times, accepted twice; 1: reached 2, accepted 1; 2: reached 1, accepted 1
    assert out["per_position_acceptance"] == [pytest.approx(2 / 3, abs=1e-4), 0.5, 1.0]
    assert out["gamma"] == {"mode": 3, "mean": pytest.approx(8 / 3, abs=1e-4), "max": 3}


def test_extended_fields() -> None:
    stats, _ = scripted()
    out = stats.to_dict(extended=True)
    assert out["draft_s"] == pytest.approx(0.08) and out["verify_s"] == pytest.approx(0.4)
    assert out["overhead_s"] == pytest.approx(0.05)
    assert out["accepted_length_histogram"] == [1, 1, 0, 1]  # accepted 0, 1, 2, 3 tokens
    assert out["tokens_per_step"] == pytest.approx(9 / 5)
    assert out["alpha_hat"] == pytest.approx(4 / 6, abs=1e-4)  # 4 accepted, 2 steps ended in a rejection
    # from own counters: mean γ 8/3, T_t(1) = 0.08 (plain steps), speculating step = 0.08 + 0.08/3 of drafting
    expected = expected_tokens(4 / 6, 8 / 3) * 0.08 / (0.08 / 3 + 0.08)
    assert out["expected_speedup"] == pytest.approx(expected, abs=1e-3)
    stats.set_expected_speedup(1.234567)  # the policy's estimate wins when given
    assert stats.to_dict(extended=True)["expected_speedup"] == 1.2346


def test_nothing_to_count_is_null_never_nan() -> None:
    empty = SpecStats(clock=Clock())
    for stats in (empty, plain_only()):
        out = stats.to_dict(extended=True)
        text = json.dumps(out, allow_nan=False)  # raises on NaN/inf
        assert out["acceptance_rate"] is None and out["mean_accepted_length"] is None
        assert out["gamma"] == {"mode": None, "mean": None, "max": None}
        assert out["per_position_acceptance"] == [] and out["expected_speedup"] is None
        assert "NaN" not in text
        assert all(not (isinstance(v, float) and math.isnan(v)) for v in out.values())
    assert empty.to_dict()["tok_s"] is None and empty.to_dict()["ttft_s"] is None
    assert plain_only().to_dict()["tok_s"] is not None


def plain_only() -> SpecStats:
    clock = Clock()
    stats = SpecStats(clock=clock)
    clock.t += 0.2
    stats.observe_prefill(tokens=5, seconds=0.2)
    for _ in range(3):
        clock.t += 0.05
        stats.observe_step(gamma=0, accepted=0, emitted=1, paused=False, draft_s=0.0, verify_s=0.05, overhead_s=0.0)
    return stats


def test_window_tok_s_and_snapshot() -> None:
    clock = Clock()
    stats = SpecStats(clock=clock, window_s=2.0)
    clock.t += 1.0  # a slow prefill must not depress the live rate
    stats.observe_prefill(tokens=100, seconds=1.0)
    # steps of 0.125 s (exact in binary, so no event sits on the window's edge by rounding)
    for _ in range(24):  # 3 s of steps, 4 tokens each
        clock.t += 0.125
        stats.observe_step(gamma=3, accepted=3, emitted=4, paused=False, draft_s=0.0, verify_s=0.1, overhead_s=0.0)
    assert stats.window_tok_s() == 32.0
    for _ in range(8):  # then 1 s at 1 token a step: the 2 s window sees half and half
        clock.t += 0.125
        stats.observe_step(gamma=3, accepted=0, emitted=1, paused=False, draft_s=0.0, verify_s=0.1, overhead_s=0.0)
    assert stats.window_tok_s() == (8 * 4 + 8 * 1) / 2.0
    snap = stats.snapshot()
    assert snap["new_tokens"] == 1 + 96 + 8 and snap["gamma"] == 3 and snap["paused"] is False
    assert snap["window_tok_s"] == stats.window_tok_s()
    json.dumps(snap, allow_nan=False)
    assert len(stats._window) == 16  # the window holds only its last 2 s of events
    early = SpecStats(clock=clock)
    early.observe_prefill(tokens=3, seconds=0.0)
    clock.t += 0.5
    early.observe_step(gamma=0, accepted=0, emitted=2, paused=False, draft_s=0.0, verify_s=0.5, overhead_s=0.0)
    assert early.window_tok_s() == 4.0  # shorter than the window so far: divided by the time decoding ran


def test_start_resets_and_validation() -> None:
    stats, clock = scripted()
    stats.start()
    assert stats.to_dict()["new_tokens"] == 0 and stats.to_dict()["steps"] == 0
    stats.start(t0=clock.t - 2.0)  # the request began 2 s ago (queued behind another one)
    clock.t += 1.0
    stats.observe_prefill(tokens=1, seconds=0.5)
    assert stats.to_dict()["ttft_s"] == pytest.approx(3.0) and stats.to_dict()["wall_s"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="accepted <= gamma"):
        stats.observe_step(gamma=2, accepted=3, emitted=4, paused=False, draft_s=0, verify_s=0, overhead_s=0)
