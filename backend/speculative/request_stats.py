"""One request's statistics: the clock (first token, last token, prefill) around a :class:`StepCounts`, and the
:class:`~specchat.backend.api.RequestStats` every consumer reads (the UI live, `specchat generate --json`,
`specchat serve`, the history); the engine attaches one to every StepEvent. Pure Python (no torch).

The counts and their definitions (accepted, rejected, discarded, τ, per-position acceptance) are ``stats.py``'s:
this module only reports them, so every consumer shows the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specchat.backend.api import PolicyState, RequestStats
from specchat.backend.speculative.stats import StepCounts, rate


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
        self.constraint: tuple[float, int, int] | None = None  # (mask seconds, masks, forced drafts) with a grammar

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
            tok_s=rate(self.new_tokens, wall, 2) if self.new_tokens else None,
            steps=steps,
            spec_paused_steps=c.paused_steps,
            drafted=c.drafted,
            accepted=c.accepted,
            rejected=c.rejected,
            discarded=c.discarded,
            acceptance_rate=c.acceptance_rate,
            mean_accepted_length=c.mean_accepted_length,
            per_position_acceptance=tuple(c.per_position_acceptance()),
            gamma=c.gamma_summary(),
            prompt_tokens=prompt_tokens,
            drafter=c.busiest_drafter() or drafter,
            draft_s=round(sum(c.draft_s.values()), 6),
            verify_s=round(c.verify_s, 6),
            overhead_s=round(c.overhead_s, 6),
            tokens_per_step=rate(c.spec_emitted + c.plain_emitted, steps),
            alpha_hat=c.alpha_hat,
            expected_speedup=self.expected_speedup(),
            accepted_length_histogram=tuple(c.accepted_lengths.get(k, 0) for k in range(longest + 1)),
            spec_tok_s=rate(c.spec_emitted, c.spec_time_s, 2),
            plain_tok_s=rate(c.plain_emitted, c.plain_time_s, 2),
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
            mask_s=round(self.constraint[0], 6) if self.constraint is not None else None,
            masks=self.constraint[1] if self.constraint is not None else None,
            forced_tokens=self.constraint[2] if self.constraint is not None else None,
        )
