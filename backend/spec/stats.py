"""SpecStats: one request's counters, and the rates the UI and `specchat generate --json` report.

The engine calls :meth:`SpecStats.observe_prefill` once (the first token comes from the prefill pass) and
:meth:`SpecStats.observe_step` after every later target pass. :meth:`SpecStats.to_dict` is the --json "stats"
object, exactly the fields of the generate contract; ``to_dict(extended=True)`` adds timing totals, the
accepted-length histogram and the expected speed-up. :meth:`SpecStats.snapshot` is the cheap live view.

Definitions (design.md vocabulary):

- ``steps``: target passes after prefill; ``spec_paused_steps``: those run plain because the policy paused;
  a *speculating step* is one where at least one token was drafted (``gamma`` > 0 in observe_step: the tokens
  really drafted, which the step's StepEvent reports as ``gamma``).
- ``acceptance_rate`` = accepted / drafted.
- ``mean_accepted_length`` τ = 1 + accepted / speculating steps: tokens a speculating step yields, the recovered
  or bonus one included (vLLM's "mean acceptance length"). Plain steps are left out so τ describes the
  drafter, not how often speculation was on; ``tokens_per_step`` (extended) is the all-steps figure.
- ``per_position_acceptance[i]`` = steps that accepted draft position i / steps that reached it (drafted more
  than i tokens and accepted all before i).
- ``gamma``: mode (smallest on ties), mean and max of the drafted length over speculating steps.
- ``wall_s``: from the request's start (construction, or :meth:`start`) to the last token; ``ttft_s`` to the
  first. ``tok_s`` = new_tokens / wall_s. A rate with nothing to count is None (JSON null), never NaN.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from specchat.backend.spec.policy import expected_tokens


def _rate(num: float, den: float, digits: int = 4) -> float | None:
    return round(num / den, digits) if den else None


def _secs(x: float) -> float:
    return round(x, 6)


class SpecStats:
    """Counters of one request. ``clock`` is injectable for tests; ``window_s`` is the live tok/s window."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, window_s: float = 2.0) -> None:
        self._clock = clock
        self.window_s = window_s
        self.start()

    def start(self, t0: float | None = None) -> None:
        """(Re)start the request clock (at ``t0``, a reading of the same clock, if the request began earlier)
        and zero every counter."""
        self.t0 = self._clock() if t0 is None else t0
        self.t_first: float | None = None  # first token
        self.t_decode: float | None = None  # end of prefill: the live window's earliest start
        self.t_last: float | None = None
        self.new_tokens = 0
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.steps = 0
        self.spec_steps = 0
        self.spec_paused_steps = 0
        self.rejected_steps = 0  # speculating steps that ended in a rejection
        self.drafted = 0
        self.accepted = 0
        self.emitted_in_steps = 0
        self.draft_s = 0.0
        self.verify_s = 0.0
        self.overhead_s = 0.0
        self.plain_verify_s = 0.0  # target time of steps with nothing drafted (T_t(1) from own counters)
        self.plain_steps = 0
        self.reached: list[int] = []  # per draft position: steps that reached it
        self.accepted_at: list[int] = []  # per draft position: steps that accepted it
        self.gammas: Counter[int] = Counter()  # drafted length -> speculating steps
        self.accepted_lengths: Counter[int] = Counter()  # accepted count -> speculating steps
        self.last_gamma = 0
        self.last_paused = False
        self.policy_estimate: float | None = None
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens emitted) within window_s

    # ------------------------------------------------------------------------------------------- observing
    def _emit(self, n: int) -> None:
        if n <= 0:
            return
        now = self._clock()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.new_tokens += n
        self._window.append((now, n))
        while self._window and self._window[0][0] <= now - self.window_s:
            self._window.popleft()

    def observe_prefill(self, *, tokens: int, seconds: float, emitted: int = 1) -> None:
        """The prefill pass: ``tokens`` actually prefilled (after prefix reuse) in ``seconds``; it yields
        ``emitted`` tokens (the first one)."""
        self.prefill_tokens += tokens
        self.prefill_s += seconds
        self._emit(emitted)
        self.t_decode = self._clock()

    def observe_step(
        self,
        *,
        gamma: int,
        accepted: int,
        emitted: int,
        paused: bool,
        draft_s: float,
        verify_s: float,
        overhead_s: float,
    ) -> None:
        """One target pass after prefill. ``gamma``: tokens drafted this step (0 for a plain step); ``accepted``
        of them kept by verification; ``emitted``: tokens it yielded (accepted + 1, fewer when EOS or the
        token limit cut it); ``paused``: plain because the policy paused speculation."""
        if not 0 <= accepted <= gamma:
            raise ValueError(f"SpecStats.observe_step: need 0 <= accepted <= gamma, got {accepted}, {gamma}")
        self.steps += 1
        self.spec_paused_steps += bool(paused)
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.overhead_s += overhead_s
        self.emitted_in_steps += emitted
        self.last_gamma = gamma
        self.last_paused = paused
        if gamma > 0:
            self.spec_steps += 1
            self.drafted += gamma
            self.accepted += accepted
            self.rejected_steps += accepted < gamma
            self.gammas[gamma] += 1
            self.accepted_lengths[accepted] += 1
            if len(self.reached) < gamma:
                grow = gamma - len(self.reached)
                self.reached.extend([0] * grow)
                self.accepted_at.extend([0] * grow)
            for i in range(min(accepted + 1, gamma)):
                self.reached[i] += 1
            for i in range(accepted):
                self.accepted_at[i] += 1
        else:
            self.plain_steps += 1
            self.plain_verify_s += verify_s
        self._emit(emitted)

    def set_expected_speedup(self, value: float | None) -> None:
        """The policy's S(γ) with its estimates (preferred over the one computed from these counters)."""
        self.policy_estimate = value

    # ----------------------------------------------------------------------------------------------- rates
    @property
    def wall_s(self) -> float:
        return (self.t_last - self.t0) if self.t_last is not None else 0.0

    def acceptance_rate(self) -> float | None:
        return _rate(self.accepted, self.drafted)

    def mean_accepted_length(self) -> float | None:
        return round(1.0 + self.accepted / self.spec_steps, 4) if self.spec_steps else None

    def alpha_hat(self) -> float | None:
        """Per-position acceptance over the request: accepted / (accepted + steps ending in a rejection)."""
        return _rate(self.accepted, self.accepted + self.rejected_steps)

    def window_tok_s(self, now: float | None = None) -> float | None:
        """Tokens/s over the last ``window_s`` seconds of decoding (prefill excluded)."""
        now = self._clock() if now is None else now
        start = max(now - self.window_s, self.t_decode if self.t_decode is not None else self.t0)
        tokens = sum(n for t, n in self._window if t > now - self.window_s and t > start)
        return _rate(tokens, now - start, 2) if now > start else None

    def expected_speedup(self) -> float | None:
        """The policy's estimate if given, else S from this request's own counters: α̂, the mean drafted length,
        mean draft time per token, mean target time of plain and of speculating steps."""
        if self.policy_estimate is not None:
            return round(self.policy_estimate, 4)
        alpha = self.alpha_hat()
        if alpha is None or not self.plain_steps or not self.spec_steps:
            return None
        gamma = self.drafted / self.spec_steps
        t1 = self.plain_verify_s / self.plain_steps
        t_spec = (self.verify_s - self.plain_verify_s) / self.spec_steps
        tokens = expected_tokens(alpha, gamma)  # a mean γ is fine in the formula
        cost = self.draft_s / self.spec_steps + t_spec
        return _rate(tokens * t1, cost)

    def gamma_summary(self) -> dict[str, float | int | None]:
        if not self.spec_steps:
            return {"mode": None, "mean": None, "max": None}
        mode = min(self.gammas, key=lambda g: (-self.gammas[g], g))
        return {"mode": mode, "mean": _rate(self.drafted, self.spec_steps), "max": max(self.gammas)}

    def to_dict(self, *, extended: bool = False) -> dict[str, Any]:
        """The `specchat generate --json` "stats" object (``extended`` adds diagnostics under extra keys)."""
        wall = self.wall_s
        out: dict[str, Any] = {
            "new_tokens": self.new_tokens,
            "wall_s": _secs(wall),
            "prefill_s": _secs(self.prefill_s),
            "ttft_s": _secs(self.t_first - self.t0) if self.t_first is not None else None,
            "prefill_tokens": self.prefill_tokens,
            "tok_s": _rate(self.new_tokens, wall, 2) if self.new_tokens else None,
            "steps": self.steps,
            "spec_paused_steps": self.spec_paused_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate(),
            "mean_accepted_length": self.mean_accepted_length(),
            "per_position_acceptance": [_rate(a, r) for a, r in zip(self.accepted_at, self.reached)],
            "gamma": self.gamma_summary(),
        }
        if extended:
            longest = max(self.gammas, default=-1)
            out.update(
                draft_s=_secs(self.draft_s),
                verify_s=_secs(self.verify_s),
                overhead_s=_secs(self.overhead_s),
                tokens_per_step=_rate(self.emitted_in_steps, self.steps),
                alpha_hat=self.alpha_hat(),
                expected_speedup=self.expected_speedup(),
                accepted_length_histogram=[self.accepted_lengths.get(k, 0) for k in range(longest + 1)],
            )
        return out

    def snapshot(self) -> dict[str, Any]:
        """The live view for the UI: cheap (no per-step history is walked beyond the short tok/s window)."""
        return {
            "new_tokens": self.new_tokens,
            "tok_s": _rate(self.new_tokens, self.wall_s, 2) if self.new_tokens else None,
            "window_tok_s": self.window_tok_s(),
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate(),
            "mean_accepted_length": self.mean_accepted_length(),
            "expected_speedup": self.expected_speedup(),
            "gamma": self.last_gamma,
            "paused": self.last_paused,
        }
