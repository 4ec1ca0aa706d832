"""policy.py with injected costs and acceptance: a simulated world (true α, target cost
T_t(n) = t1·(1 + c·(n−1)), draft cost per token) drives GammaPolicy step by step, as the engine would, and the
tests check its decisions."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from specchat.backend.events import PolicyState
from specchat.backend.policy import GammaPolicy, expected_tokens


@dataclass
class World:
    alpha: float
    slope: float  # T_t(n) = t1 * (1 + slope * (n - 1))
    t1: float = 0.010
    draft_per_token: float = 0.0
    max_proposal: int | None = None  # a drafter that proposes at most this many (prompt lookup)
    seed: int = 0
    log: list[tuple[int, int, PolicyState]] = field(default_factory=list)  # (γ asked, proposed, state after)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def t_target(self, n: int) -> float:
        return self.t1 * (1.0 + self.slope * (n - 1))

    def run(self, policy: GammaPolicy, steps: int) -> None:
        for _ in range(steps):
            gamma = policy.choose()
            proposed = gamma if self.max_proposal is None else min(gamma, self.max_proposal)
            accepted = 0
            while accepted < proposed and self.rng.random() < self.alpha:
                accepted += 1
            policy.observe(
                gamma=gamma,
                accepted=accepted,
                draft_s=proposed * self.draft_per_token,
                verify_s=self.t_target(proposed + 1),
                proposed=proposed,
            )
            self.log.append((gamma, proposed, policy.state))

    def recent_gammas(self, n: int) -> list[int]:
        return [g for g, _, _ in self.log[-n:] if g > 0]


def test_prior_before_any_measurement() -> None:
    policy = GammaPolicy(max_gamma=8)
    assert policy.alpha_hat() is None and policy.expected_speedup() is None
    assert policy.state is PolicyState.SPECULATING
    assert 1 <= policy.choose() <= 8  # speculates from the first step on the prior
    assert policy.target_time(5) == pytest.approx(1.0 + 0.08 * 4)  # relative units until measured
    assert policy.estimates()["alpha_hat"] is None


def test_gamma_grows_when_alpha_high_and_verification_cheap() -> None:
    policy, world = GammaPolicy(max_gamma=10), World(alpha=0.9, slope=0.02)
    first = policy.choose()
    world.run(policy, 120)
    recent = world.recent_gammas(30)
    assert min(recent) >= 8 and max(recent) == 10 and max(recent) > first
    assert policy.alpha_hat() == pytest.approx(0.9, abs=0.08)
    assert all(state is PolicyState.SPECULATING for _, _, state in world.log)


def test_gamma_shrinks_when_alpha_falls() -> None:
    policy, world = GammaPolicy(max_gamma=10), World(alpha=0.9, slope=0.1)
    world.run(policy, 120)
    high = sorted(world.recent_gammas(30))[15]
    world.alpha = 0.4
    world.run(policy, 120)
    low = sorted(world.recent_gammas(30))[15]
    assert high >= 6 and low <= 3  # at α = 0.4, S(γ) peaks at γ = 1..2 with this cost slope
    assert policy.state is PolicyState.SPECULATING  # S(1) = 1.4 / 1.1 still pays: no pause


def test_pauses_when_it_cannot_pay_then_probes_with_backoff() -> None:
    policy = GammaPolicy(max_gamma=10, probe_after=16, max_probe_after=128)
    world = World(alpha=0.1, slope=0.3)  # S(1) = 1.1 / 1.3 < 1, and worse for every larger γ
    world.run(policy, 10)
    paused_at = next(i for i, (_, _, state) in enumerate(world.log) if state is PolicyState.PAUSED) + 1
    assert paused_at <= 8  # warm-up (4 drafted steps) and one plain step to measure T_t(1), then off
    world.run(policy, 400)
    tail = world.log[paused_at:]
    drafted = [i for i, (g, _, _) in enumerate(tail) if g > 0]
    assert len(drafted) < 0.1 * len(tail)  # mostly plain decoding
    # probes: runs of drafted steps separated by plain gaps that double (16, 32, 64, 128, 128, ...)
    starts = [i for i in drafted if i == 0 or tail[i - 1][0] == 0]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]
    assert policy.probe_after == 128
    assert policy.expected_speedup() < 1.0


def test_resumes_when_alpha_recovers() -> None:
    policy = GammaPolicy(max_gamma=10, probe_after=16, max_probe_after=64)
    world = World(alpha=0.1, slope=0.3)
    world.run(policy, 300)
    assert policy.state is PolicyState.PAUSED
    world.alpha = 0.9
    world.run(policy, 64 + 10)  # the next probe comes within max_probe_after plain steps
    world.run(policy, 50)
    assert policy.state is PolicyState.SPECULATING
    assert all(state is PolicyState.SPECULATING for _, _, state in world.log[-50:])
    assert sorted(world.recent_gammas(30))[15] >= 3
    assert policy.probe_after == 16  # backoff reset once it paid again


def test_fixed_gamma_never_pauses() -> None:
    policy, world = GammaPolicy(fixed_gamma=4), World(alpha=0.0, slope=0.5)
    world.run(policy, 200)
    assert {g for g, _, _ in world.log} == {4}
    assert all(state is PolicyState.SPECULATING for _, _, state in world.log)
    assert policy.alpha_hat() == pytest.approx(0.0, abs=0.01)
    assert policy.expected_speedup() < 1.0  # honest about it, but it keeps the γ it was given


def test_short_and_empty_proposals_count_what_was_drafted() -> None:
    """A prompt-lookup-like drafter proposes at most 2 tokens, all accepted: α̂ must reach ~1 (no rejections
    ever happened), not be dragged down by the γ that was asked for."""
    policy, world = GammaPolicy(max_gamma=10), World(alpha=1.0, slope=0.05, max_proposal=2)
    world.run(policy, 100)
    assert policy.alpha_hat() > 0.95


def test_empty_proposals_are_plain_steps_for_t1() -> None:
    policy = GammaPolicy()
    for _ in range(10):
        gamma = policy.choose()
        assert gamma > 0  # never a calibration step: the no-match steps already measure T_t(1)
        policy.observe(gamma=gamma, accepted=0, draft_s=1e-5, verify_s=0.020, proposed=0)
        policy.observe(gamma=gamma, accepted=1, draft_s=1e-5, verify_s=0.021, proposed=1)
    assert policy.target_time(1) == pytest.approx(0.020)
    assert policy.target_time(2) == pytest.approx(0.021)


def test_calibration_step_measures_t1_when_drafts_never_fail_to_come() -> None:
    policy = GammaPolicy(warmup_steps=4, calibrate_every=20)
    world = World(alpha=0.7, slope=0.1, draft_per_token=0.001)
    world.run(policy, 60)
    plain = [i for i, (g, _, state) in enumerate(world.log) if g == 0]
    assert plain and plain[0] == 4  # right after the warm-up drafted steps
    assert all(world.log[i][2] is PolicyState.SPECULATING for i in plain)
    assert len(plain) == 3  # then once per 20 drafted steps
    assert policy.target_time(1) == pytest.approx(0.010)
    assert policy.draft_time() == pytest.approx(0.001)


def test_target_time_estimates() -> None:
    policy = GammaPolicy()
    for _ in range(3):
        policy.observe(gamma=0, accepted=0, draft_s=0.0, verify_s=0.010, proposed=0)
    assert policy.target_time(6) == pytest.approx(0.010 * (1 + 0.08 * 5))  # one n measured: prior shape
    for _ in range(3):
        policy.observe(gamma=2, accepted=1, draft_s=0.0, verify_s=0.012, proposed=2)
    assert policy.target_time(5) == pytest.approx(0.014)  # linear fit through n = 1 and n = 3
    assert policy.target_time(3) == pytest.approx(0.012)  # measured n: its own median
    policy.observe(gamma=2, accepted=1, draft_s=0.0, verify_s=1.0, proposed=2)  # one very slow pass
    assert policy.target_time(3) == pytest.approx(0.012)


def test_speedup_formula() -> None:
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(1.0, 4) == 5.0
    policy = GammaPolicy()
    for _ in range(5):
        policy.observe(gamma=0, accepted=0, draft_s=0.0, verify_s=0.010, proposed=0)
        policy.observe(gamma=3, accepted=3, draft_s=0.003, verify_s=0.013, proposed=3)
    alpha = policy.alpha_hat()
    expected = expected_tokens(alpha, 3) * 0.010 / (3 * 0.001 + 0.013)
    assert policy.expected_speedup(3) == pytest.approx(expected)


def test_invalid_use() -> None:
    with pytest.raises(ValueError, match="fixed_gamma"):
        GammaPolicy(fixed_gamma=0)
    with pytest.raises(ValueError, match="accepted <= proposed"):
        GammaPolicy().observe(gamma=3, accepted=3, draft_s=0.0, verify_s=0.01, proposed=2)


def test_reset_keeps_costs_and_restarts_speculation() -> None:
    policy, world = GammaPolicy(), World(alpha=0.05, slope=0.3)
    world.run(policy, 40)
    assert policy.state is PolicyState.PAUSED
    t1 = policy.target_time(1)
    policy.reset()
    assert policy.state is PolicyState.SPECULATING and policy.alpha_hat() is None
    assert policy.target_time(1) == t1 and policy.choose() > 0
