"""Choosing γ each step, and switching speculation off while it does not pay.

The expected speed-up of drafting γ tokens over plain decoding, with measured inputs:

    S(γ) = E[N](α̂, γ) · T_t(1) / (γ · T_d + T_t(γ+1)),   E[N] = (1 − α̂^(γ+1)) / (1 − α̂)

- α̂, the per-position acceptance, = accepted / (accepted + steps that ended in a rejection): the maximum-
  likelihood α of a geometric run cut at the draft length. Counts decay by ``decay`` per drafted step (an
  effective window of ~1/(1−decay) steps) so α̂ follows the conversation; they start from a prior
  (``alpha_prior`` with ``prior_weight`` pseudo-counts) and only what was really drafted counts
  (``proposed``, which may be below γ: prompt lookup without a match proposes nothing).
- E[N] uses the same estimator *at each draft position k*: α̂_k = accepted at k / (accepted at k + rejected
  at k), over the steps that reached k (the same decayed counts). A constant α̂_k gives back the geometric
  E[N] above; real drafts are not geometric. Prompt lookup copying a passage is bimodal: a draft is either
  wrong from its first token or right for a long run, so α̂_k rises with k, and the geometric formula with
  the pooled α̂ would undervalue long drafts exactly where they pay most (code edits). Each α̂_k is shrunk
  towards α̂_{k−1} (α̂_0 towards the pooled α̂) with ``position_weight`` pseudo-counts, so a position with
  little evidence, or none yet (beyond every γ tried), takes its neighbour's value:
  E[N](γ) = 1 + Σ_{k<γ} Π_{j≤k} α̂_j.
- T_t(n), the target's pass over n tokens, is *measured*: a running median of the recent passes at each n
  (robust to one slow first call), and for n never tried a weighted linear fit a + b·n over the measured n
  (b >= 0). With one measured n only, or none, the prior shape T_t(n) = T_t(1)·(1 + 0.08·(n − 1)) fills in.
  Between two measured n the estimate interpolates linearly, and past the largest measured n it grows by the
  fit's slope over the measured n >= 2 only: on a CPU a pass over 2 tokens costs markedly more than one over 1
  (matrix-vector vs matrix-matrix kernels; ``benchmarks/RESULTS.md``, "Figures moved out of the code") while
  2..24 tokens cost about the same, so a line through n = 1 would make long drafts look far dearer than they are.
  T_t(1) comes from plain steps: those with nothing proposed, those while paused, and a *calibration* step
  (``choose()`` returns 0 while SPECULATING) once ``warmup_steps`` drafted steps passed without any plain
  step, and again after every ``calibrate_every`` drafted steps without one.
- T_d, the drafter's time per proposed token, is a running median too (prior ``draft_cost_prior`` · T_t(1)).

:meth:`GammaPolicy.choose` returns the γ maximising S, or 0 while PAUSED. After ``warmup_steps`` drafted steps,
a best S below ``min_speedup − margin`` (with T_t(1) measured) pauses speculation, and so does not one token
accepted in those steps, whatever S says: over a long context a pass over γ+1 tokens costs about one over 1,
so S stays near 1 however low α̂ falls (the prior keeps it above 0) while each drafted step still costs
drafting and bookkeeping for nothing. After ``probe_after`` plain steps it probes again for ``probe_steps``
drafted steps (with γ at least ``probe_gamma``, the old α̂ shrunk to a couple of pseudo-counts so the probe's
evidence decides) and resumes if the best S then reaches ``min_speedup`` and the probe had a token accepted;
otherwise it pauses again and doubles ``probe_after`` (up to ``max_probe_after``). ``fixed_gamma`` keeps
speculation on at that γ always (the estimates are still kept for display).

The engine calls ``choose()`` before, and ``observe()`` after, every step after prefill, plain ones included.
"""

from __future__ import annotations

import statistics
from collections import deque

from specchat.backend.api import PolicyState
from specchat.backend.speculative.stats import expected_tokens_table, judged_positions, speedup

_WINDOW = 9  # samples per running median


class _Median:
    """Running median of the last _WINDOW samples (the value is cached: read far more often than written)."""

    __slots__ = ("samples", "value")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_WINDOW)
        self.value = 0.0

    def add(self, x: float) -> None:
        self.samples.append(float(x))
        self.value = statistics.median(self.samples)


class GammaPolicy:
    """Adaptive γ with auto-off (see the module docstring). Not thread-safe: one engine owns it."""

    def __init__(
        self,
        *,
        fixed_gamma: int | None = None,
        max_gamma: int = 10,
        min_speedup: float = 1.0,
        margin: float = 0.03,
        alpha_prior: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.95,
        cost_slope_prior: float = 0.08,
        draft_cost_prior: float = 0.02,
        warmup_steps: int = 4,
        probe_after: int = 16,
        max_probe_after: int = 128,
        probe_steps: int = 4,
        probe_gamma: int = 3,
        calibrate_every: int = 64,
        position_weight: float = 1.0,
    ) -> None:
        if fixed_gamma is not None and not (isinstance(fixed_gamma, int) and fixed_gamma >= 1):
            raise ValueError(f"GammaPolicy: fixed_gamma must be an integer >= 1, got {fixed_gamma!r}")
        if not (isinstance(max_gamma, int) and max_gamma >= 1):
            raise ValueError(f"GammaPolicy: max_gamma must be an integer >= 1, got {max_gamma!r}")
        self.fixed_gamma = fixed_gamma
        self.max_gamma = max(max_gamma, fixed_gamma or 1)
        self.min_speedup = min_speedup
        self.margin = margin
        self.alpha_prior = alpha_prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.cost_slope_prior = cost_slope_prior
        self.draft_cost_prior = draft_cost_prior
        self.warmup_steps = warmup_steps
        self.base_probe_after = probe_after
        self.max_probe_after = max_probe_after
        self.probe_steps = probe_steps
        self.probe_gamma = probe_gamma
        self.calibrate_every = calibrate_every
        self.position_weight = position_weight
        self._target: dict[int, _Median] = {}  # n -> recent target pass times over n tokens (seconds)
        self._fit: tuple[float, float] | None = None  # (a, b) of T_t(n) ≈ a + b·n over the measured n
        self._speedup_cache: list[float] | None = None
        self._draft = _Median()  # recent draft times per proposed token (seconds)
        self.reset()

    # ----------------------------------------------------------------------------------------------- state
    def reset(self) -> None:
        """A new conversation: acceptance back to the prior and speculation on; measured costs are kept."""
        self._speedup_cache = None
        self._succ = self.alpha_prior * self.prior_weight
        self._fail = (1.0 - self.alpha_prior) * self.prior_weight
        self._pos_succ = [0.0] * self.max_gamma  # per draft position k: decayed accepts at k
        self._pos_fail = [0.0] * self.max_gamma  # per draft position k: decayed rejections at k
        self._drafted_steps = 0  # drafted steps ever observed (alpha_hat is None before the first)
        self._since_start = 0  # drafted steps since speculation (re)started
        self._accepted_since_start = 0  # tokens accepted in those steps
        self._probing = 0  # drafted steps left in the current probe
        self._plain_while_paused = 0
        self._drafted_since_plain = 0  # drafted steps since T_t(1) was last measured
        self.probe_after = self.base_probe_after
        self.state = PolicyState.SPECULATING

    # ------------------------------------------------------------------------------------------- estimates
    def alpha_hat(self) -> float | None:
        """Per-position acceptance estimate; None until a draft was verified."""
        if self._drafted_steps == 0:
            return None
        return self._alpha()

    def _alpha(self) -> float:
        return min(self._succ / (self._succ + self._fail), 1.0 - 1e-9)

    def position_alphas(self) -> list[float]:
        """α̂_k for draft positions k = 0 .. max_gamma − 1 (see the module docstring)."""
        out, prev, w = [], self._alpha(), self.position_weight
        for succ, fail in zip(self._pos_succ, self._pos_fail):
            prev = min((succ + w * prev) / (succ + fail + w), 1.0 - 1e-9)
            out.append(prev)
        return out

    def expected_tokens(self, gamma: int) -> float:
        """E[N](γ) from the per-position estimates: tokens a step drafting γ yields, the target's own included."""
        return self._expected_table()[min(gamma, self.max_gamma)]

    def _expected_table(self) -> list[float]:
        return expected_tokens_table(self.position_alphas())

    def _prior_ratio(self, n: int) -> float:
        return 1.0 + self.cost_slope_prior * (n - 1)

    def target_time(self, n: int) -> float:
        """Estimated target pass time over n tokens, seconds (in units of T_t(1) = 1 before any measurement)."""
        measured = self._target.get(n)
        if measured is not None:
            return measured.value
        below = [m for m in self._target if m < n]
        above = [m for m in self._target if m > n]
        if below and above:  # interpolate between the nearest measured neighbours
            lo, hi = max(below), min(above)
            t_lo, t_hi = self._target[lo].value, self._target[hi].value
            return t_lo + (t_hi - t_lo) * (n - lo) / (hi - lo)
        if below and self._fit is not None:  # past the largest measured n: grow by the fitted slope
            top = max(below)
            return self._target[top].value + self._fit[1] * (n - top)
        if self._fit is not None:
            intercept, slope = self._fit
            estimate = intercept + slope * n
            if estimate > 0.0:
                return estimate
        if self._target:
            m = min(self._target)  # the smallest measured n, scaled by the prior shape
            return self._target[m].value / self._prior_ratio(m) * self._prior_ratio(n)
        return self._prior_ratio(n)

    def _refit(self) -> None:
        # Weighted least squares T ≈ a + b·n over the measured n (weight: samples held), b clamped at >= 0;
        # over n >= 2 only once two such n are measured (n = 1 runs other kernels, see the module docstring).
        self._fit = None
        points = [(m, med.value, len(med.samples)) for m, med in self._target.items()]
        if sum(m >= 2 for m, _, _ in points) >= 2:
            points = [p for p in points if p[0] >= 2]
        if len(points) < 2:
            return
        w_sum = sum(w for _, _, w in points)
        n_mean = sum(m * w for m, _, w in points) / w_sum
        t_mean = sum(t * w for _, t, w in points) / w_sum
        var = sum(w * (m - n_mean) ** 2 for m, _, w in points)
        slope = max(0.0, sum(w * (m - n_mean) * (t - t_mean) for m, t, w in points) / var)
        self._fit = (t_mean - slope * n_mean, slope)

    def draft_time(self) -> float:
        """Estimated draft time per proposed token, seconds (prior: a fraction of T_t(1))."""
        if self._draft.samples:
            return self._draft.value
        return self.draft_cost_prior * self.target_time(1)

    def _speedup(self, gamma: int) -> float:
        speedups = self._speedups()
        if gamma < len(speedups):
            return speedups[gamma]
        return self._formula(gamma, self._expected_table(), self.target_time(1), self.draft_time())

    def _formula(self, gamma: int, table: list[float], t1: float, td: float) -> float:
        return speedup(
            table[min(gamma, self.max_gamma)], gamma, t1=t1, draft_s_per_token=td, target_s=self.target_time(gamma + 1)
        )

    def _speedups(self) -> list[float]:
        """S(γ) for γ = 0 .. max_gamma (index γ; S(0) = 1, a plain step). Cached until the next observe():
        choose(), the engine's comparison of drafters and the display all read it between steps."""
        if self._speedup_cache is None:
            table, t1, td = self._expected_table(), self.target_time(1), self.draft_time()
            self._speedup_cache = [1.0] + [self._formula(g, table, t1, td) for g in range(1, self.max_gamma + 1)]
        return self._speedup_cache

    def _best(self) -> tuple[int, float]:
        speedups = self._speedups()
        score, neg_gamma = max((speedups[g], -g) for g in range(1, self.max_gamma + 1))
        return -neg_gamma, score

    def expected_speedup(self, gamma: int | None = None) -> float | None:
        """S(γ) from the current estimates (γ None: the best γ, or the fixed one); None before any draft."""
        if self._drafted_steps == 0:
            return None
        if gamma is None:
            gamma = self.fixed_gamma if self.fixed_gamma is not None else self._best()[0]
        return self._speedup(gamma) if gamma > 0 else 1.0

    def estimates(self) -> dict[str, float | int | str | None]:
        """The inputs and outputs of the formula, for the live display and --json diagnostics."""
        return {
            "state": self.state.value,
            "alpha_hat": self.alpha_hat(),
            "target_s_1": self.target_time(1) if self._target else None,
            "draft_s_per_token": self._draft.value if self._draft.samples else None,
            "best_gamma": self.fixed_gamma if self.fixed_gamma is not None else self._best()[0],
            "expected_speedup": self.expected_speedup(),
            "probe_after": self.probe_after,
        }

    # -------------------------------------------------------------------------------------------- decisions
    def choose(self) -> int:
        """γ for the next step; 0 = run a plain step (speculation paused)."""
        if self.fixed_gamma is not None:
            return self.fixed_gamma
        if self.state is PolicyState.PAUSED:
            if self._plain_while_paused < self.probe_after:
                return 0
            self._start_probe()
        elif self._needs_calibration():
            return 0
        gamma, _ = self._best()
        if self._probing:
            gamma = max(gamma, min(self.probe_gamma, self.max_gamma))
        return gamma

    def _needs_calibration(self) -> bool:
        # S(γ) is relative to T_t(1): measure it with a plain step once warm, and again every calibrate_every
        # drafted steps without one (a drafter that always proposes never yields a plain step by itself).
        if self._probing or self._drafted_since_plain < self.warmup_steps:
            return False
        return 1 not in self._target or self._drafted_since_plain >= self.calibrate_every

    def _start_probe(self) -> None:
        # Shrink the stale evidence to a couple of pseudo-counts (same ratio): the probe's own steps decide.
        self._speedup_cache = None
        total = self._succ + self._fail
        if total > self.prior_weight:
            scale = self.prior_weight / total
            self._succ *= scale
            self._fail *= scale
            self._pos_succ = [x * scale for x in self._pos_succ]
            self._pos_fail = [x * scale for x in self._pos_fail]
        self.state = PolicyState.SPECULATING
        self._probing = self.probe_steps
        self._since_start = 0
        self._accepted_since_start = 0

    def _pause(self) -> None:
        self.state = PolicyState.PAUSED
        self._plain_while_paused = 0
        self._probing = 0

    def observe(
        self, *, gamma: int, accepted: int, draft_s: float, verify_s: float, proposed: int, tried: int | None = None
    ) -> None:
        """Record one step: γ asked for, tokens really ``proposed`` (<= γ) and ``accepted`` (<= proposed), the
        drafting time and the target pass time (over proposed + 1 tokens). A step with proposed 0 is plain.
        A tree of ``proposed`` nodes gives ``tried``, the positions judged along the followed path (accepted,
        plus one where no child matched): acceptance counts those positions, the pass time all the nodes."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"GammaPolicy.observe: need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        if tried is not None and not accepted <= tried <= min(accepted + 1, proposed):
            raise ValueError(f"GammaPolicy.observe: tried {tried} must be accepted ({accepted}) or one more")
        n = proposed + 1
        self._speedup_cache = None
        if verify_s > 0.0:
            self._target.setdefault(n, _Median()).add(verify_s)
            self._refit()
        if proposed == 0:
            self._drafted_since_plain = 0
        if proposed > 0:
            if draft_s > 0.0:
                self._draft.add(draft_s / proposed)
            self._succ = self._succ * self.decay + accepted
            judged = judged_positions(accepted, proposed, tried)
            self._fail = self._fail * self.decay + (1.0 if accepted < judged else 0.0)
            pos_succ, pos_fail, decay = self._pos_succ, self._pos_fail, self.decay
            for k in range(len(pos_succ)):
                pos_succ[k] *= decay
                pos_fail[k] *= decay
                if k < accepted:
                    pos_succ[k] += 1.0
                elif k == accepted and k < judged:
                    pos_fail[k] += 1.0
            self._drafted_steps += 1
            self._drafted_since_plain += 1
        if self.fixed_gamma is not None:
            return
        if self.state is PolicyState.PAUSED:
            if proposed == 0:
                self._plain_while_paused += 1
            return
        if proposed == 0:
            return  # nothing was drafted: no evidence about speculation
        self._since_start += 1
        self._accepted_since_start += accepted
        best = self._best()[1]
        if self._probing:
            self._probing -= 1
            if self._probing:
                return
            if best >= self.min_speedup and self._accepted_since_start:
                self.probe_after = self.base_probe_after  # it pays again: back to speculating
            else:
                self.probe_after = min(self.probe_after * 2, self.max_probe_after)
                self._pause()
            return
        if self._since_start >= self.warmup_steps and not self._accepted_since_start:
            self._pause()  # nothing accepted: speculation cannot pay (see the module docstring)
        elif self._since_start >= self.warmup_steps and 1 in self._target and best < self.min_speedup - self.margin:
            self._pause()
