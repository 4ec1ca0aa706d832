"""The one place speculation is counted and its speed-up computed: per request, and across requests for the bench.

Pure Python (no torch). Three layers:

- The formula, shared by the γ policy (``policy.py``), the request statistics and the bench:
  E[N](γ) = 1 + Σ_{k<γ} Π_{j≤k} α_j, from per-position acceptance α_j (:func:`expected_tokens_table`), and
  S = E[N] · T_t(1) / (γ · T_d + T_t(γ+1)) (:func:`speedup`), with measured pass times.
- :class:`StepCounts`: mergeable counts over decoding steps (prefill excluded), per drafter: steps by γ, per
  draft position how many steps reached and accepted it, target pass times by tokens per pass, drafting times,
  emitted tokens and step time of speculating and of plain steps. A request's travel in its RequestStats
  (``step_counts``); the bench and `specchat serve` add them up across requests instead of recounting steps.
- :class:`SpecStats`: one request: a :class:`StepCounts` plus the request's clock (first token, last token,
  prefill). :meth:`SpecStats.report` builds the :class:`~specchat.backend.api.RequestStats` every consumer
  reads (the UI live, `specchat generate --json`, the history); the engine attaches one to every StepEvent.

Definitions (the vocabulary of ``backend/api.py``): a *speculating step* drafted at least one token; a step
with nothing drafted is *plain*: ``paused`` when the policy paused speculation, ``no draft`` when a drafter
was on but nothing was verified for another reason; per-position acceptance α_i = steps
that accepted draft position i / steps that reached it (drafted more than i tokens and accepted every one
before i). A position never reached counts as α = 0 in E[N].
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from specchat.backend.api import GammaSummary, PolicyState, RequestStats


def judged_positions(accepted: int, drafted: int, tried: int | None = None) -> int:
    """Draft positions the target judged in one step (the one definition the statistics and the γ policy use):
    a chain of ``drafted`` tokens judged ``min(accepted + 1, drafted)``; a tree gives ``tried`` (the positions
    along the followed path: accepted, plus one where no child matched)."""
    return min(accepted + 1, drafted) if tried is None else tried


def expected_tokens_table(alphas: Sequence[float]) -> list[float]:
    """E[N](γ) for γ = 0 .. len(alphas): tokens a step drafting γ yields (the target's own one included)."""
    table, run, total = [1.0], 1.0, 1.0
    for alpha in alphas:
        run *= alpha
        total += run
        table.append(total)
    return table


def speedup(expected: float, gamma: int, *, t1: float, draft_s_per_token: float, target_s: float) -> float:
    """S = E[N] · T_t(1) / (γ · T_d + T_t(γ+1)): tokens per second drafting γ over tokens per second plain."""
    return expected * t1 / (gamma * draft_s_per_token + target_s)


def _rate(num: float, den: float, digits: int = 4) -> float | None:
    return round(num / den, digits) if den else None


def _step_key(text: str) -> tuple[str, int]:
    """(drafter, γ) from StepCounts.to_dict's "drafter/γ"."""
    drafter, _, gamma = text.rpartition("/")
    return drafter, int(gamma)


def _add_rows(mine: list[int], theirs: Sequence[int]) -> None:
    mine.extend([0] * (len(theirs) - len(mine)))
    for i, value in enumerate(theirs):
        mine[i] += value


@dataclass(slots=True)
class StepCounts:
    """Counts over decoding steps, mergeable (see the module docstring)."""

    steps: Counter[tuple[str, int]] = field(default_factory=Counter)  # (drafter, γ) -> steps; ("none", 0): plain
    draft_s: dict[tuple[str, int], float] = field(default_factory=dict)  # (drafter, γ) -> seconds drafting
    pass_s: dict[int, list[float]] = field(default_factory=dict)  # tokens per pass n -> [seconds, passes]
    reached: dict[str, list[int]] = field(default_factory=dict)  # drafter -> per position: steps reaching it
    accepted_at: dict[str, list[int]] = field(default_factory=dict)  # drafter -> per position: steps accepting it
    accepted_lengths: Counter[int] = field(default_factory=Counter)  # accepted count -> speculating steps
    kept: Counter[str] = field(default_factory=Counter)  # drafter -> accepted drafts in the reply (a stop cuts some)
    drafted: int = 0
    accepted: int = 0
    rejected_steps: int = 0  # speculating steps that ended in a rejection
    paused_steps: int = 0
    no_draft_steps: int = 0
    spec_emitted: int = 0
    plain_emitted: int = 0
    spec_time_s: float = 0.0  # draft + verify + overhead of speculating steps
    plain_time_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0

    def observe(
        self,
        *,
        drafter: str,
        gamma: int,
        accepted: int,
        emitted: int,
        draft_s: float,
        verify_s: float,
        overhead_s: float = 0.0,
        paused: bool = False,
        no_draft: bool = False,
        tried: int | None = None,
    ) -> None:
        """One step: ``gamma`` tokens drafted by ``drafter`` (0: plain), ``accepted`` of them kept, ``emitted``
        tokens yielded (accepted + 1, fewer when EOS or the token limit cut the step). A tree of ``gamma`` nodes
        gives ``tried``: the positions judged along the followed path (accepted, plus one where no child
        matched); a chain judged ``min(accepted + 1, gamma)``."""
        if not 0 <= accepted <= gamma:
            raise ValueError(f"StepCounts.observe: need 0 <= accepted <= gamma, got {accepted}, {gamma}")
        judged = judged_positions(accepted, gamma, tried)
        key = (drafter if gamma else "none", gamma)
        self.steps[key] += 1
        self.draft_s[key] = self.draft_s.get(key, 0.0) + draft_s
        slot = self.pass_s.setdefault(gamma + 1, [0.0, 0])
        slot[0] += verify_s
        slot[1] += 1
        self.verify_s += verify_s
        self.overhead_s += overhead_s
        self.paused_steps += bool(paused)
        self.no_draft_steps += bool(no_draft)
        step_s = draft_s + verify_s + overhead_s
        if not gamma:
            self.plain_emitted += emitted
            self.plain_time_s += step_s
            return
        reached = self.reached.setdefault(drafter, [])
        taken = self.accepted_at.setdefault(drafter, [])
        if len(reached) < gamma:
            reached.extend([0] * (gamma - len(reached)))
            taken.extend([0] * (gamma - len(taken)))
        for i in range(judged):
            reached[i] += 1
        for i in range(accepted):
            taken[i] += 1
        self.drafted += gamma
        self.accepted += accepted
        self.kept[drafter] += min(accepted, emitted)
        self.rejected_steps += accepted < judged
        self.accepted_lengths[accepted] += 1
        self.spec_emitted += emitted
        self.spec_time_s += step_s

    def merge(self, other: StepCounts) -> None:
        self.steps.update(other.steps)
        for key, seconds in other.draft_s.items():
            self.draft_s[key] = self.draft_s.get(key, 0.0) + seconds
        for n, (seconds, passes) in other.pass_s.items():
            slot = self.pass_s.setdefault(n, [0.0, 0])
            slot[0] += seconds
            slot[1] += passes
        for name, counts in other.reached.items():
            _add_rows(self.reached.setdefault(name, []), counts)
            _add_rows(self.accepted_at.setdefault(name, []), other.accepted_at[name])
        self.accepted_lengths.update(other.accepted_lengths)
        self.kept.update(other.kept)
        for name in _TOTALS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready counts (keys "drafter/γ" and str(n)), all of them (:meth:`from_dict` reads them back), and
        the acceptance rate and τ they give."""
        return {
            "steps": {f"{d}/{g}": n for (d, g), n in self.steps.items()},
            "draft_s": {f"{d}/{g}": s for (d, g), s in self.draft_s.items()},
            "pass_s": {str(n): list(v) for n, v in self.pass_s.items()},
            "reached": {d: list(v) for d, v in self.reached.items()},
            "accepted_at": {d: list(v) for d, v in self.accepted_at.items()},
            "accepted_lengths": {str(k): n for k, n in self.accepted_lengths.items()},
            "kept": dict(self.kept),
            **{name: getattr(self, name) for name in _TOTALS},
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepCounts:
        """The counts :meth:`to_dict` wrote (a RequestStats' ``step_counts``); KeyError / ValueError for others."""
        return cls(
            steps=Counter({_step_key(k): n for k, n in data["steps"].items()}),
            draft_s={_step_key(k): s for k, s in data["draft_s"].items()},
            pass_s={int(n): list(v) for n, v in data["pass_s"].items()},
            reached={d: list(v) for d, v in data["reached"].items()},
            accepted_at={d: list(v) for d, v in data["accepted_at"].items()},
            accepted_lengths=Counter({int(k): n for k, n in data["accepted_lengths"].items()}),
            kept=Counter(data.get("kept", {})),  # absent from counts stored before predictions
            **{name: data[name] for name in _TOTALS},
        )

    # -- derived ------------------------------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        return sum(self.steps.values())

    @property
    def spec_steps(self) -> int:
        return sum(n for (_, gamma), n in self.steps.items() if gamma)

    @property
    def acceptance_rate(self) -> float | None:
        return _rate(self.accepted, self.drafted)

    @property
    def mean_accepted_length(self) -> float | None:
        """τ = 1 + accepted / speculating steps (the recovered or bonus token counts)."""
        steps = self.spec_steps
        return round(1.0 + self.accepted / steps, 4) if steps else None

    @property
    def alpha_hat(self) -> float | None:
        """Pooled per-position acceptance: accepted / (accepted + steps ending in a rejection)."""
        return _rate(self.accepted, self.accepted + self.rejected_steps)

    def per_position_acceptance(self, drafter: str | None = None) -> list[float | None]:
        """α_i for ``drafter`` (None: every drafter pooled); None where no step reached position i."""
        names = [drafter] if drafter is not None else list(self.reached)
        reached: list[int] = []
        taken: list[int] = []
        for name in names:
            _add_rows(reached, self.reached.get(name, []))
            _add_rows(taken, self.accepted_at.get(name, []))
        return [_rate(a, r) for a, r in zip(taken, reached)]

    def drafted_by(self, drafter: str) -> int:
        """Tokens ``drafter`` proposed and the target verified."""
        return sum(gamma * n for (name, gamma), n in self.steps.items() if name == drafter)

    def mean_pass_s(self, n: int) -> float | None:
        seconds, passes = self.pass_s.get(n, (0.0, 0))
        return seconds / passes if passes else None

    def gamma_summary(self) -> GammaSummary:
        gammas: Counter[int] = Counter()
        for (_, gamma), n in self.steps.items():
            if gamma:
                gammas[gamma] += n
        if not gammas:
            return GammaSummary()
        mode = min(gammas, key=lambda g: (-gammas[g], g))
        return GammaSummary(mode=mode, mean=_rate(self.drafted, sum(gammas.values())), max=max(gammas))

    def busiest_drafter(self) -> str | None:
        """The drafter of the most speculating steps (None without any)."""
        by_drafter: Counter[str] = Counter()
        for (name, gamma), n in self.steps.items():
            if gamma:
                by_drafter[name] += n
        return max(by_drafter, key=lambda name: by_drafter[name]) if by_drafter else None

    def expected_speedup(self, t1: float | None) -> float | None:
        """S over the steps taken: Σ E[N](γ_s) / Σ (T_d(γ_s) + T_t(γ_s+1)) · T_t(1), E[N] from each drafter's
        per-position acceptance; ``t1`` is plain decoding's mean pass time (None: not measured)."""
        if t1 is None or not self.steps:
            return None
        tokens = seconds = 0.0
        tables = {
            name: expected_tokens_table([a or 0.0 for a in self.per_position_acceptance(name)]) for name in self.reached
        }
        for (name, gamma), count in self.steps.items():
            table = tables.get(name, [1.0])
            target = self.mean_pass_s(gamma + 1)
            if target is None:
                return None
            tokens += count * table[min(gamma, len(table) - 1)]
            seconds += count * target + self.draft_s[(name, gamma)]
        return tokens / seconds * t1 if seconds > 0 else None


# The plain totals (the number fields): added by merge, written and read as they are by to_dict / from_dict.
_TOTALS = tuple(f.name for f in fields(StepCounts) if isinstance(f.default, (int, float)))


class SpecStats:
    """One request's statistics. ``clock`` is injectable for tests.

    The engine calls :meth:`observe_prefill` once (the first token comes from the prefill pass), then
    :meth:`observe_step` after every later target pass, and :meth:`report` for each event.
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.perf_counter, t0: float | None = None, seed: int | None = None
    ) -> None:
        self._clock = clock
        self.seed = seed  # the seed the reply is sampled with (reported so it can be replayed)
        self.draft_context: tuple[int, int] | None = None  # (fed, reused) at the draft model's first draft
        self.t0 = clock() if t0 is None else t0  # the request's start (prompt rendering included)
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.new_tokens = 0
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.counts = StepCounts()
        self.last_gamma = 0
        self.last_policy: PolicyState | None = None
        self.policy_estimate: float | None = None  # the γ policy's S, preferred over the counts' own
        self.policy_estimates: Mapping[str, Any] | None = None
        self.tree = (0, 0, 0, 0, 0)  # the latest tree draft: nodes, depth, leaves, accepted depth, branch
        self.prediction: tuple[str, int] | None = None  # (its drafter's name, its tokens) with a prediction

    def _emit(self, n: int) -> None:
        if n <= 0:
            return
        now = self._clock()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.new_tokens += n

    def observe_prefill(
        self, *, tokens: int, seconds: float, emitted: int = 1, policy: PolicyState | None = None
    ) -> None:
        """The prefill pass: ``tokens`` actually prefilled (after prefix reuse) in ``seconds``; it yields
        ``emitted`` tokens (the first one)."""
        self.prefill_tokens += tokens
        self.prefill_s += seconds
        self.last_policy = policy
        self._emit(emitted)

    def observe_step(
        self,
        *,
        drafter: str,
        gamma: int,
        accepted: int,
        emitted: int,
        policy: PolicyState,
        draft_s: float,
        verify_s: float,
        overhead_s: float,
        tried: int | None = None,
    ) -> None:
        """One target pass after prefill (see :meth:`StepCounts.observe`)."""
        self.counts.observe(
            drafter=drafter,
            gamma=gamma,
            accepted=accepted,
            emitted=emitted,
            draft_s=draft_s,
            verify_s=verify_s,
            overhead_s=overhead_s,
            paused=policy is PolicyState.PAUSED,
            no_draft=policy is PolicyState.NO_DRAFT,
            tried=tried,
        )
        self.last_gamma = gamma
        self.last_policy = policy
        self._emit(emitted)

    def observe_tree(self, parents: Sequence[int], path: Sequence[int]) -> None:
        """The shape of the tree the last step verified (``parents`` as in a Draft) and the accepted ``path``
        (node indices): kept for the live view (RequestStats.tree_*)."""
        depth: list[int] = []
        for parent in parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        leaves = len(parents) - len({p for p in parents if p >= 0})
        roots = [i for i, p in enumerate(parents) if p < 0]
        branch = roots.index(path[0]) + 1 if path else 0
        self.tree = (len(parents), max(depth, default=0), leaves, len(path), branch)

    def observe_draft_context(self, drafter: str, *, prefilled: int, reused: int) -> None:
        """A drafter with a cache read the context: ``prefilled`` ids fed, ``reused`` found cached. The first
        time in a request is its prefill (later ones catch up on the tokens of the last step)."""
        if self.draft_context is None:
            self.draft_context = (prefilled, reused)

    def set_policy(self, expected_speedup: float | None, estimates: Mapping[str, Any] | None) -> None:
        """The γ policy's S and estimates (a single drafter); preferred over the counts' own S."""
        self.policy_estimate, self.policy_estimates = expected_speedup, estimates

    @property
    def wall_s(self) -> float:
        return (self.t_last - self.t0) if self.t_last is not None else 0.0

    def expected_speedup(self) -> float | None:
        if self.policy_estimate is not None:
            return round(self.policy_estimate, 4)
        value = self.counts.expected_speedup(self.counts.mean_pass_s(1))
        return round(value, 4) if value is not None and self.counts.spec_steps else None

    def report(self, *, prompt_tokens: int = 0, drafter: str = "none") -> RequestStats:
        """The request's statistics now. ``drafter``: reported when no drafter ran a speculating step."""
        c, wall = self.counts, self.wall_s
        name, predicted = self.prediction or ("", None)
        steps = c.total_steps
        longest = max(c.accepted_lengths, default=-1)
        return RequestStats(
            new_tokens=self.new_tokens,
            wall_s=round(wall, 6),
            prefill_s=round(self.prefill_s, 6),
            ttft_s=round(self.t_first - self.t0, 6) if self.t_first is not None else None,
            prefill_tokens=self.prefill_tokens,
            tok_s=_rate(self.new_tokens, wall, 2) if self.new_tokens else None,
            steps=steps,
            spec_paused_steps=c.paused_steps,
            drafted=c.drafted,
            accepted=c.accepted,
            acceptance_rate=c.acceptance_rate,
            mean_accepted_length=c.mean_accepted_length,
            per_position_acceptance=tuple(c.per_position_acceptance()),
            gamma=c.gamma_summary(),
            prompt_tokens=prompt_tokens,
            drafter=c.busiest_drafter() or drafter,
            draft_s=round(sum(c.draft_s.values()), 6),
            verify_s=round(c.verify_s, 6),
            overhead_s=round(c.overhead_s, 6),
            tokens_per_step=_rate(c.spec_emitted + c.plain_emitted, steps),
            alpha_hat=c.alpha_hat,
            expected_speedup=self.expected_speedup(),
            accepted_length_histogram=tuple(c.accepted_lengths.get(k, 0) for k in range(longest + 1)),
            spec_tok_s=_rate(c.spec_emitted, c.spec_time_s, 2),
            plain_tok_s=_rate(c.plain_emitted, c.plain_time_s, 2),
            last_gamma=self.last_gamma,
            last_policy=self.last_policy,
            policy=self.policy_estimates,
            step_counts=c.to_dict(),
            no_draft_steps=c.no_draft_steps,
            draft_prefill_tokens=self.draft_context[0] if self.draft_context else 0,
            draft_reused_tokens=self.draft_context[1] if self.draft_context else 0,
            seed=self.seed,
            tree_nodes=self.tree[0],
            tree_depth=self.tree[1],
            tree_width=self.tree[2],
            tree_accepted=self.tree[3],
            tree_branch=self.tree[4],
            prediction_tokens=predicted,
            accepted_prediction_tokens=c.kept[name] if predicted is not None else None,
            rejected_prediction_tokens=c.drafted_by(name) - c.kept[name] if predicted is not None else None,
        )
