"""policy.py with injected costs and acceptance: a simulated world (true α, target cost
T_t(n) = t1·(1 + c·(n−1)), draft cost per token) drives GammaPolicy step by step, as the engine would, and the
tests check its decisions."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from specchat.backend.api import PolicyState
from specchat.backend.speculative.policy import GammaPolicy
from specchat.backend.speculative.stats import expected_tokens_table


def expected_tokens(alpha: float, gamma: int) -> float:
    """The geometric E[N] of a constant per-position acceptance ``alpha``."""
    return expected_tokens_table([alpha] * gamma)[gamma]


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


@pytest.mark.parametrize("slope", [0.0, 0.002, 0.01])
def test_nothing_accepted_pauses_within_the_first_steps_on_a_long_context(slope: float) -> None:
    """Over a ~5,000-token context a pass over γ+1 tokens costs about one over 1 (attention over the context
    dominates), so S(γ) stays near 1 however low α̂ falls; before the zero-acceptance rule prompt lookup drafted
    on for the whole reply (issue 19: 294 tokens drafted, none accepted)."""
    policy = GammaPolicy(max_gamma=31)
    world = World(alpha=0.0, slope=slope, t1=2.8, draft_per_token=0.0005)
    world.run(policy, 10)
    paused_at = next((i for i, (_, _, state) in enumerate(world.log) if state is PolicyState.PAUSED), None)
    assert paused_at is not None and paused_at < 6  # the warm-up's 4 drafted steps
    assert all(g == 0 for g, _, _ in world.log[paused_at + 1 :])
    world.run(policy, 200)
    drafted_steps = sum(1 for g, _, _ in world.log if g > 0)
    assert drafted_steps <= 4 + 4 * 4  # warm-up, then short probes that back off (16, 32, 64, 128 plain steps)
    assert policy.state is PolicyState.PAUSED


def test_a_probe_without_an_accepted_token_does_not_resume() -> None:
    policy = GammaPolicy(max_gamma=10, probe_after=16)
    world = World(alpha=0.0, slope=0.0, t1=1.0)
    world.run(policy, 4 + 16 + 4)  # warm-up, the pause, one probe
    assert policy.state is PolicyState.PAUSED and policy.probe_after == 32


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
    assert policy.target_time(2) == pytest.approx(0.011)  # between n = 1 and n = 3: interpolated
    assert policy.target_time(5) == pytest.approx(0.014)  # past n = 3: the fit's slope (n = 1 and n = 3)
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
    a = policy.position_alphas()
    tokens = 1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2]
    assert policy.expected_tokens(3) == pytest.approx(tokens)
    assert policy.expected_speedup(3) == pytest.approx(tokens * 0.010 / (3 * 0.001 + 0.013))


def test_constant_acceptance_gives_the_geometric_formula() -> None:
    """When every position is accepted at the same rate, E[N] from per-position estimates is the geometric
    (1 − α^(γ+1)) / (1 − α) of the pooled α̂."""
    # decay=1: nothing forgotten, so even position 6 (reached by 0.7^5 of the steps) converges
    policy, world = GammaPolicy(max_gamma=6, fixed_gamma=6, decay=1.0), World(alpha=0.7, slope=0.05, seed=3)
    world.run(policy, 3000)
    assert policy.alpha_hat() == pytest.approx(0.7, abs=0.06)
    assert all(a == pytest.approx(0.7, abs=0.1) for a in policy.position_alphas())
    assert policy.expected_tokens(6) == pytest.approx(expected_tokens(policy.alpha_hat(), 6), rel=0.03)


def test_per_position_acceptance_follows_a_bimodal_drafter() -> None:
    """Prompt lookup copying a passage: a draft is wrong at its first token (60%) or right all along. A step
    drafting γ yields 1 + 0.4·γ tokens. The pooled α̂ (≈ 0.91 at γ = 16) fed to the geometric formula would
    promise ~4.2 tokens from a 4-token draft that yields 2.6, and ~8.7 from a 16-token one that yields 7.4:
    E[N] must follow the positions, not the pooled α̂."""
    policy = GammaPolicy(max_gamma=16, fixed_gamma=16)
    rng = random.Random(5)
    for _ in range(400):
        right = 0 if rng.random() < 0.6 else 100
        policy.observe(gamma=16, accepted=min(16, right), draft_s=0.0, verify_s=0.01, proposed=16)
    alphas = policy.position_alphas()
    assert alphas[0] == pytest.approx(0.4, abs=0.15) and min(alphas[1:]) > 0.9
    assert policy.alpha_hat() > 0.85
    for gamma in (4, 16):
        truth = 1 + 0.4 * gamma
        assert policy.expected_tokens(gamma) == pytest.approx(truth, rel=0.3)
        assert expected_tokens(policy.alpha_hat(), gamma) > truth + 1.0  # what the pooled α̂ would claim


def test_long_runs_and_a_cpu_cost_curve_choose_long_drafts() -> None:
    """On a CPU a pass over 2..24 tokens costs about the same (~1.7x a 1-token pass), and 25+ more. A drafter
    right in long runs (mean 25) 60% of the time, wrong at once otherwise: the adaptive policy, starting from
    its prior and learning costs as it goes, gets within 10% of the best fixed γ's throughput, with γ well
    past the 10 a fixed prompt-lookup setting would use."""

    def cost(n: int) -> float:
        return 0.097 if n == 1 else 0.165 + 0.0025 * (n - 2) + (0.03 if n > 24 else 0.0)

    def runs(seed: int) -> list[int]:
        rng = random.Random(seed)
        return [0 if rng.random() < 0.4 else 1 + int(rng.expovariate(1 / 25)) for _ in range(600)]

    def throughput(choose, observe) -> float:
        tokens = seconds = 0.0
        for right in runs(11):
            gamma = choose()
            observe(gamma, min(gamma, right))
            tokens += min(gamma, right) + 1
            seconds += cost(gamma + 1)
        return tokens / seconds

    best_fixed = max(throughput(lambda g=g: g, lambda *_: None) for g in range(1, 32))
    policy, chosen = GammaPolicy(max_gamma=31), []

    def observe(gamma: int, accepted: int) -> None:
        chosen.append(gamma)
        policy.observe(gamma=gamma, accepted=accepted, draft_s=1e-5 * gamma, verify_s=cost(gamma + 1), proposed=gamma)

    adaptive = throughput(policy.choose, observe)
    assert adaptive >= 0.9 * best_fixed
    assert sorted(chosen[-200:])[100] >= 14
    assert policy.state is PolicyState.SPECULATING


def test_cost_between_and_past_measured_lengths() -> None:
    """T_t(n) interpolates between measured n, and past the largest grows by the slope fitted over n >= 2
    (not through n = 1, which on a CPU is far cheaper than any longer pass)."""
    policy = GammaPolicy()
    for _ in range(3):
        policy.observe(gamma=0, accepted=0, draft_s=0.0, verify_s=0.100, proposed=0)
        policy.observe(gamma=3, accepted=1, draft_s=0.0, verify_s=0.170, proposed=3)
        policy.observe(gamma=9, accepted=2, draft_s=0.0, verify_s=0.182, proposed=9)
    assert policy.target_time(7) == pytest.approx(0.170 + 0.012 * 3 / 6)
    assert policy.target_time(20) == pytest.approx(0.182 + 0.002 * 10)


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
