"""Speculation in a batch: γ per stream from the measured cost of a pass by its rows and each stream's acceptance.

Alone, a stream's γ is :class:`~specchat.backend.speculative.policy.GammaPolicy`'s (S(γ) against its own pass
times). In a batch of B streams a pass over R rows costs T(R) for all of them, and what counts is the batch's
tokens per second, Σ_i E_i[N](γ_i) / (T(B + Σ γ_i + prefill rows) + Σ_i γ_i · T_d,i + the time between passes,
the streams' own bookkeeping): a draft row pays only
if the tokens it is expected to add are worth the time it adds to everyone's pass. While passes are memory-bound
(T(R) ≈ T(1)) drafts cost almost nothing; as rows fill the pass, T(R) grows with R and the same drafts stop
paying, so speculation shrinks and switches off as streams join, and comes back as they leave.

- :class:`PassCost`: T(R), a running median of the measured passes at each row count R (the batch's own passes,
  and a calibration at start when given one), made non-decreasing in R (a weighted isotonic fit over the
  medians, weights their samples: one slow pass while another program held a core must not make 8 rows look
  dearer than 9 and steer the allocation), linear between measured R and by the last slope beyond them;
  before any measurement, the prior shape T(R) = T(1) · (1 + 0.5 · (R − 1)).
- :func:`allocate`: the γ of each stream maximising that ratio, greedily: from every γ at its floor (0, or 1 for
  a stream's first drafted steps, whose acceptance is not known yet), the one change of one
  stream's γ that raises the ratio most, until none does. E_i[N](γ) is the stream's policy's own estimate
  (per-position acceptance); a paused policy offers no drafts.
- :class:`BatchPolicy`: a stream's GammaPolicy in a batch: ``cap`` (set before each pass; None while the stream
  is alone) is its γ while it shares passes (the allocation weighed its acceptance against the batch's pass cost;
  its own lone-stream choice, S(γ) over its own pass times, does not apply to a shared pass), 0 while paused; a
  pass shared with other streams does not count as its own pass time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specchat.backend.api import PolicyState
from specchat.backend.speculative.policy import GammaPolicy, _Median

PRIOR_SLOPE = 0.5  # T(R) / T(1) grows by this per row before the curve is measured (CPU passes, 2 cores)


class PassCost:
    """T(R): seconds of a target pass over R rows (see the module docstring)."""

    def __init__(self) -> None:
        self._t: dict[int, _Median] = {}
        self._memo: dict[int, float] = {}  # time() by rows until the next observation (allocate asks often)
        self._fit: dict[int, float] | None = None  # the monotone curve until the next observation

    def observe(self, rows: int, seconds: float) -> None:
        if rows >= 1 and seconds > 0.0:
            self._t.setdefault(rows, _Median()).add(seconds)
            self._memo.clear()
            self._fit = None

    def curve(self) -> dict[int, float]:
        """The measured medians, by rows."""
        known = dict(self._t)  # a copy first: /metrics reads it from another thread while passes add to it
        return {r: m.value for r, m in sorted(known.items())}

    def monotone(self) -> dict[int, float]:
        """The medians made non-decreasing in rows: pool adjacent violators, each median weighted by its samples."""
        if self._fit is None:
            known = dict(self._t)
            blocks: list[list[float]] = []  # [value, weight, rows in the block]
            for rows in sorted(known):
                median = known[rows]
                blocks.append([median.value, float(len(median.samples) or 1), 1.0])
                while len(blocks) >= 2 and blocks[-2][0] > blocks[-1][0]:
                    v2, w2, n2 = blocks.pop()
                    v1, w1, n1 = blocks.pop()
                    blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
            values = [v for v, _, n in blocks for _ in range(int(n))]
            self._fit = dict(zip(sorted(known), values, strict=True))
        return self._fit

    def time(self, rows: int) -> float:
        if (memo := self._memo.get(rows)) is None:
            memo = self._memo[rows] = self._estimate(rows)
        return memo

    def _estimate(self, rows: int) -> float:
        known = self.monotone()
        if rows in known:
            return known[rows]
        if not known:
            return 1.0 + PRIOR_SLOPE * (rows - 1)
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            t_lo, t_hi = known[lo], known[hi]
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        ordered = sorted(known)
        if len(ordered) >= 2:  # beyond the measured rows: the slope of the nearest two, at least 0
            a, b = (ordered[-2], ordered[-1]) if below else (ordered[0], ordered[1])
            slope = max((known[b] - known[a]) / (b - a), 0.0)
            edge = ordered[-1] if below else ordered[0]
            return max(known[edge] + slope * (rows - edge), 1e-9)
        only = ordered[0]
        return known[only] * (1.0 + PRIOR_SLOPE * (rows - 1)) / (1.0 + PRIOR_SLOPE * (only - 1))


@dataclass(frozen=True)
class Offer:
    """What one stream offers the allocation: E[N](γ) for γ = 0 .. len - 1 (E[N](0) = 1), and its drafting time
    per token (seconds)."""

    expected: Sequence[float]
    draft_s: float
    floor: int = 0  # γ it gets whatever the cost: its first drafted steps, the evidence its acceptance needs


def allocate(offers: Sequence[Offer], base_rows: int, cost: PassCost, between_s: float = 0.0) -> list[int]:
    """γ per stream maximising the batch's tokens per second (see the module docstring); ``base_rows``: the
    pass's rows before any draft (one per decoding stream, fixed drafts, a prefill piece); ``between_s``: the
    time between two passes (the streams' verifying, detokenising, drafting), which drafts do not add to."""
    gammas = [min(o.floor, len(o.expected) - 1) for o in offers]
    tokens = sum(o.expected[g] for o, g in zip(offers, gammas, strict=True))
    rows = base_rows + sum(gammas)
    drafting = between_s + sum(g * o.draft_s for o, g in zip(offers, gammas, strict=True))
    best_rate = tokens / (cost.time(rows) + drafting)
    while True:
        move: tuple[float, int, int] | None = None
        for i, offer in enumerate(offers):
            now = gammas[i]
            for g in range(now + 1, len(offer.expected)):
                extra = g - now
                rate = (tokens + offer.expected[g] - offer.expected[now]) / (
                    cost.time(rows + extra) + drafting + extra * offer.draft_s
                )
                if rate > best_rate * 1.001 and (move is None or rate > move[0]):
                    move = (rate, i, g)
        if move is None:
            return gammas
        best_rate, i, g = move
        extra = g - gammas[i]
        tokens += offers[i].expected[g] - offers[i].expected[gammas[i]]
        rows += extra
        drafting += extra * offers[i].draft_s
        gammas[i] = g


class BatchPolicy(GammaPolicy):
    """A stream's policy in a batch (see the module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cap: int | None = None  # γ the batch allows this stream (None: alone, its own choice)
        self.shared = False  # the stream's last pass held other streams' rows

    def offer(self, max_gamma: int, one_row_s: float) -> Offer:
        """E[N](γ) for γ up to ``max_gamma`` (only γ 0 while paused) and the drafting time per token (before it
        was measured, the prior's share of ``one_row_s``, a one-row pass)."""
        paused = self.state is PolicyState.PAUSED
        top = 0 if paused or self.fixed_gamma is not None else min(max_gamma, self.max_gamma)
        draft_s = self._draft.value if self._draft.samples else self.draft_cost_prior * one_row_s
        table = self._expected_table()
        # Until it has drafted a few steps its acceptance is the prior's: it drafts one token to learn it (else a
        # batch that never lets it draft would never find a stream whose drafts pay).
        floor = min(1, top) if self._drafted_steps < self.warmup_steps else 0
        return Offer(table[: top + 1], draft_s, floor)

    def learn_costs(self, cost: PassCost) -> None:
        """Start from the batch's measured pass times (a pass over n rows alone costs what the batch's over n
        rows did), so a stream alone chooses γ from the first step as a lone request with a warm engine does."""
        for rows, seconds in cost.monotone().items():
            self._target.setdefault(rows, _Median()).add(seconds)
        self._refit()
        self._speedup_cache = None

    def choose(self) -> int:
        own = super().choose()  # alone its choice; in a batch it still moves its state (a paused policy's probe)
        if self.cap is None:
            return own
        if self.state is PolicyState.PAUSED:
            return 0
        return self.cap

    def observe(
        self, *, gamma: int, accepted: int, draft_s: float, verify_s: float, proposed: int, tried: int | None = None
    ) -> None:
        # A shared pass's time is the batch's, not this stream's T_t(n): the allocation measures those.
        super().observe(
            gamma=gamma,
            accepted=accepted,
            draft_s=draft_s,
            verify_s=0.0 if self.shared else verify_s,
            proposed=proposed,
            tried=tried,
        )
