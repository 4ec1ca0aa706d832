"""stats.py: the one counter of speculation. A scripted request (fake clock) gives the RequestStats every consumer
reads (fields, definitions, null never NaN); StepCounts merges across requests and gives the expected speed-up
from per-position acceptance and measured pass times; the formula is the policy's."""

from __future__ import annotations

import json
import math

import pytest

from specchat.backend.api import JSON_STATS_FIELDS, GammaSummary, PolicyState
from specchat.backend.speculative.stats import SpecStats, StepCounts, expected_tokens_table, speedup

SPEC, PAUSED, OFF, NO_DRAFT = PolicyState.SPECULATING, PolicyState.PAUSED, PolicyState.OFF, PolicyState.NO_DRAFT


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def scripted() -> tuple[SpecStats, Clock]:
    """prefill 20 tokens in 0.5 s (1 token), then: γ=3 all accepted, γ=3 reject at 1, γ=2 reject at 0,
    a paused plain step, a plain step with no draft; 0.1 s a step."""
    clock = Clock()
    stats = SpecStats(clock=clock, seed=2**53 - 1)
    clock.t += 0.5
    stats.observe_prefill(tokens=20, seconds=0.5, policy=NO_DRAFT)
    stats.observe_draft_context("draft-model", prefilled=4, reused=16)  # the draft's prefill: counted once
    stats.observe_draft_context("draft-model", prefilled=2, reused=20)  # a later catch-up: not a prefill
    for gamma, accepted, policy in [(3, 3, SPEC), (3, 1, SPEC), (2, 0, SPEC), (0, 0, PAUSED), (0, 0, NO_DRAFT)]:
        clock.t += 0.1
        stats.observe_step(
            drafter="prompt-lookup",
            gamma=gamma,
            accepted=accepted,
            emitted=accepted + 1,
            policy=policy,
            draft_s=0.01 * gamma,
            verify_s=0.08,
            overhead_s=0.01,
        )
    return stats, clock


def test_request_stats_fields_and_values() -> None:
    stats, _ = scripted()
    out = stats.report(prompt_tokens=30).to_json_stats()
    assert list(out) == list(JSON_STATS_FIELDS)
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
    assert out["no_draft_steps"] == 1  # the step without a draft that the policy did not pause
    assert (out["draft_prefill_tokens"], out["draft_reused_tokens"]) == (4, 16)


def test_diagnostic_fields() -> None:
    stats, _ = scripted()
    out = stats.report(prompt_tokens=30)
    assert out.prompt_tokens == 30 and out.drafter == "prompt-lookup"
    assert out.draft_s == pytest.approx(0.08) and out.verify_s == pytest.approx(0.4)
    assert out.overhead_s == pytest.approx(0.05)
    assert out.accepted_length_histogram == (1, 1, 0, 1)  # accepted 0, 1, 2, 3 tokens
    assert out.tokens_per_step == pytest.approx(9 / 5)
    assert out.alpha_hat == pytest.approx(4 / 6, abs=1e-4)  # 4 accepted, 2 steps ended in a rejection
    assert out.last_gamma == 0 and out.last_policy is NO_DRAFT
    assert out.seed == 2**53 - 1 and out.to_dict()["seed"] == 2**53 - 1  # the history keeps it
    # speculating steps: 7 tokens in 0.1 + 0.1 + 0.1 - ... of step time; plain: 2 tokens in 0.18 s
    assert out.spec_tok_s == pytest.approx(7 / (0.03 + 0.03 + 0.02 + 3 * 0.09), abs=0.01)
    assert out.plain_tok_s == pytest.approx(2 / 0.18, abs=0.01)
    # from own counts: E[N] per step from per-position α (2/3, 1/2, 1), T(1) = 0.08 from the plain steps
    alphas = [2 / 3, 0.5, 1.0]
    table = expected_tokens_table(alphas)
    tokens = 2 * table[3] + table[2] + 2 * 1.0
    seconds = 5 * 0.08 + 0.08
    assert out.expected_speedup == pytest.approx(tokens / seconds * 0.08, abs=1e-3)
    stats.set_policy(1.234567, {"alpha_hat": 0.5})  # the policy's estimate wins when given
    assert stats.report().expected_speedup == 1.2346 and stats.report().policy == {"alpha_hat": 0.5}


def plain_only() -> SpecStats:
    clock = Clock()
    stats = SpecStats(clock=clock)
    clock.t += 0.2
    stats.observe_prefill(tokens=5, seconds=0.2, policy=OFF)
    for _ in range(3):
        clock.t += 0.05
        stats.observe_step(
            drafter="none", gamma=0, accepted=0, emitted=1, policy=OFF, draft_s=0.0, verify_s=0.05, overhead_s=0.0
        )
    return stats


def test_nothing_to_count_is_null_never_nan() -> None:
    empty = SpecStats(clock=Clock())
    for stats in (empty, plain_only()):
        report = stats.report()
        out = report.to_dict()
        text = json.dumps(out, allow_nan=False)  # raises on NaN/inf
        assert out["acceptance_rate"] is None and out["mean_accepted_length"] is None
        assert report.gamma == GammaSummary() and out["gamma"] == {"mode": None, "mean": None, "max": None}
        assert out["per_position_acceptance"] == [] and out["expected_speedup"] is None
        assert "NaN" not in text
        assert all(not (isinstance(v, float) and math.isnan(v)) for v in out.values())
    assert empty.report().tok_s is None and empty.report().ttft_s is None
    assert plain_only().report().tok_s is not None and plain_only().report().drafter == "none"


def test_the_request_clock_starts_when_the_request_did() -> None:
    clock = Clock()
    stats = SpecStats(clock=clock, t0=clock.t - 2.0)  # the request began 2 s ago (queued behind another one)
    clock.t += 1.0
    stats.observe_prefill(tokens=1, seconds=0.5)
    assert stats.report().ttft_s == pytest.approx(3.0) and stats.report().wall_s == pytest.approx(3.0)
    with pytest.raises(ValueError, match="accepted <= gamma"):
        stats.observe_step(
            drafter="x", gamma=2, accepted=3, emitted=4, policy=SPEC, draft_s=0, verify_s=0, overhead_s=0
        )


def test_step_counts_per_position_merge_and_expected_speedup() -> None:
    t = StepCounts()
    # γ=2 twice: accepted 2 then accepted 0; one paused step.
    t.observe(drafter="prompt-lookup", gamma=2, accepted=2, emitted=3, draft_s=0.0, verify_s=0.2)
    t.observe(drafter="prompt-lookup", gamma=2, accepted=0, emitted=1, draft_s=0.0, verify_s=0.2)
    t.observe(drafter="prompt-lookup", gamma=0, accepted=0, emitted=1, draft_s=0.0, verify_s=0.1, paused=True)
    assert t.per_position_acceptance("prompt-lookup") == [0.5, 1.0] and t.per_position_acceptance() == [0.5, 1.0]
    assert t.acceptance_rate == 0.5 and t.mean_accepted_length == 2.0 and t.paused_steps == 1
    # E[N](2) = 1 + .5 + .5*1 = 2; two steps of 0.2 s, one plain step E=1 of 0.1 s; T_plain(1) = 0.1.
    assert t.expected_speedup(0.1) == pytest.approx((2 * 2 + 1) / (0.2 * 2 + 0.1) * 0.1)
    merged = StepCounts()
    merged.merge(t)
    merged.merge(t)
    assert merged.per_position_acceptance("prompt-lookup") == [0.5, 1.0]
    assert merged.drafted == 8 and merged.mean_pass_s(3) == pytest.approx(0.2) and merged.total_steps == 6
    json.dumps(merged.to_dict(), allow_nan=False)


def test_the_step_counts_travel_in_the_request_stats_and_read_back_whole() -> None:
    """Figures over many requests (`specchat serve`'s /metrics, the bench) are built from these, not recounted:
    every count survives JSON, a tree step's judged positions included."""
    stats, _ = scripted()
    stats.observe_step(  # a tree of 5 nodes, 2 accepted along a path that tried 3 positions
        drafter="suffix",
        gamma=5,
        accepted=2,
        emitted=3,
        policy=SPEC,
        draft_s=0.0,
        verify_s=0.1,
        overhead_s=0.0,
        tried=3,
    )
    report = stats.report()
    assert report.step_counts == stats.counts.to_dict()
    back = StepCounts.from_dict(json.loads(json.dumps(report.to_dict()))["step_counts"])
    assert back == stats.counts and back.to_dict() == report.step_counts
    assert back.reached["suffix"] == [1, 1, 1, 0, 0] and back.accepted_at["suffix"] == [1, 1, 0, 0, 0]
    assert back.per_position_acceptance() == list(report.per_position_acceptance)


def test_the_formula() -> None:
    assert expected_tokens_table([0.5]) == [1.0, 1.5]
    assert expected_tokens_table([1.0] * 4)[4] == 5.0
    geometric = (1 - 0.7**4) / (1 - 0.7)
    assert expected_tokens_table([0.7] * 3)[3] == pytest.approx(geometric)
    assert speedup(3.0, 4, t1=0.01, draft_s_per_token=0.001, target_s=0.012) == pytest.approx(3 * 0.01 / 0.016)
