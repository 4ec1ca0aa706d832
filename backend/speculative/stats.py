"""The one place speculation is counted and its speed-up computed: per request, and across requests for the bench.

Pure Python (no torch). Three layers:

- The formula, shared by the γ policy (``policy.py``), the request statistics and the bench:
  E[N](γ) = 1 + Σ_{k<γ} Π_{j≤k} α_j, from per-position acceptance α_j (:func:`expected_tokens_table`), and
  S = E[N] · T_t(1) / (γ · T_d + T_t(γ+1)) (:func:`speedup`), with measured pass times.
- :class:`StepCounts`: mergeable counts over decoding steps (prefill excluded), per drafter: steps by γ, per
  draft position how many steps reached and accepted it, target pass times by tokens per pass, drafting times,
  emitted tokens and step time of speculating and of plain steps. A request's travel in its RequestStats
  (``step_counts``); the bench and `specchat serve` add them up across requests instead of recounting steps.
- One request's statistics (its clock, and the :class:`~specchat.backend.api.RequestStats` every consumer
  reads) are ``request_stats.py``'s :class:`~specchat.backend.speculative.request_stats.SpecStats`, built on
  these counts.

Definitions (the vocabulary of ``backend/api.py``): a *speculating step* drafted at least one token; a step
with nothing drafted is *plain*: ``paused`` when the policy paused speculation, ``no draft`` when a drafter
was on but nothing was verified for another reason. Every drafted token is counted once, as exactly one of:

- *accepted*: the target accepted it and it is in the reply;
- *discarded*: the target accepted it, but it lies past the reply's end (an EOS, a stop string or the length
  limit came first in the same step), so the reply does not hold it;
- *rejected*: the target did not accept it (the first mismatch and every draft after it; in a tree, every node
  off the followed path).

drafted = accepted + rejected + discarded; acceptance rate = accepted / drafted; τ = (accepted + 1 per
speculating step) / speculating steps = 1 + accepted / speculating steps. Per-position acceptance α_i = steps
that accepted draft position i / steps that reached it (drafted more than i tokens and accepted every one before
i), over positions inside the reply (a discarded position is neither). A position never reached counts as α = 0
in E[N].
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from specchat.backend.api import GammaSummary


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


def rate(num: float, den: float, digits: int = 4) -> float | None:
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
    accepted: int = 0  # drafted tokens the reply holds
    rejected: int = 0  # drafted tokens the target did not accept
    discarded: int = 0  # drafted tokens the target accepted past the reply's end (EOS, stop string, length)
    rejected_steps: int = 0  # speculating steps that ended in a rejection inside the reply
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
        """One step: ``gamma`` tokens drafted by ``drafter`` (0: plain), ``accepted`` of them accepted by the
        target (verification's count), ``emitted`` tokens the reply kept of the step (accepted + 1, fewer when an
        EOS, a stop string or the token limit ended the reply inside it: the accepted drafts past that end are
        counted *discarded*, not accepted). A tree of ``gamma`` nodes gives ``tried``: the positions judged along
        the followed path (accepted, plus one where no child matched); a chain judged ``min(accepted + 1,
        gamma)``."""
        if not 0 <= accepted <= gamma:
            raise ValueError(f"StepCounts.observe: need 0 <= accepted <= gamma, got {accepted}, {gamma}")
        if not 0 <= emitted <= accepted + 1:
            raise ValueError(f"StepCounts.observe: need 0 <= emitted <= accepted + 1, got {emitted}, {accepted}")
        kept = min(accepted, emitted)  # the reply holds the step's first ``emitted`` tokens: drafts first
        judged = min(judged_positions(accepted, gamma, tried), emitted)  # positions judged inside the reply
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
        for i in range(kept):
            taken[i] += 1
        self.drafted += gamma
        self.accepted += kept
        self.kept[drafter] += kept
        self.rejected += gamma - accepted
        self.discarded += accepted - kept
        self.rejected_steps += kept < judged
        self.accepted_lengths[kept] += 1
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
        return rate(self.accepted, self.drafted)

    @property
    def mean_accepted_length(self) -> float | None:
        """τ = (accepted + 1 per speculating step) / speculating steps: the recovered or bonus token counts."""
        steps = self.spec_steps
        return round(1.0 + self.accepted / steps, 4) if steps else None

    @property
    def alpha_hat(self) -> float | None:
        """Pooled per-position acceptance: accepted / (accepted + steps ending in a rejection)."""
        return rate(self.accepted, self.accepted + self.rejected_steps)

    def per_position_acceptance(self, drafter: str | None = None) -> list[float | None]:
        """α_i for ``drafter`` (None: every drafter pooled); None where no step reached position i."""
        names = [drafter] if drafter is not None else list(self.reached)
        reached: list[int] = []
        taken: list[int] = []
        for name in names:
            _add_rows(reached, self.reached.get(name, []))
            _add_rows(taken, self.accepted_at.get(name, []))
        return [rate(a, r) for a, r in zip(taken, reached)]

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
        return GammaSummary(mode=mode, mean=rate(self.drafted, sum(gammas.values())), max=max(gammas))

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
