"""Rows, token-equality checks and per-family aggregates of `specchat bench`. Pure Python: no torch.

A :class:`Row` is one (prompt, mode) generation, timed by the bench itself around the whole call, prefill
included, the same way for specchat and transformers. Specchat rows also carry a :class:`StepTally` counted
from the StepEvents (drafted/accepted per position, target pass times T(n), draft times), from which the
expected speedup of the engine II formula is computed with measured inputs:

    expected ×plain = T_plain(1) · Σ_steps E[N](γ_s) / Σ_steps (T_draft(γ_s) + T_target(γ_s + 1))
    E[N](γ) = 1 + Σ_{i=1..γ} Π_{j<=i} α_j        (α_j: measured acceptance of draft position j)

summed over the steps the mode actually took (paused steps count as γ = 0), so adaptive γ is covered. It
leaves out per-step bookkeeping, so "measured ×plain" below it shows what overheads cost.

Aggregates are totals, not means of ratios: tok/s = Σ tokens / Σ seconds over a family's prompts. When
modes stopped at different lengths on a prompt (greedy runs only), that prompt is left out of the family's
aggregates ("not comparable") as long as at least one comparable prompt remains, and the count is reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class StepTally:
    """Counts over decoding steps (prefill excluded), mergeable across prompts."""

    steps: dict[str, int] = field(default_factory=dict)  # "drafter/γ" -> steps ("none/0": plain/paused)
    draft_s: dict[str, float] = field(default_factory=dict)  # "drafter/γ" -> total seconds drafting
    pass_s: dict[str, list[float]] = field(default_factory=dict)  # str(n tokens) -> [total seconds, passes]
    reached: dict[str, list[int]] = field(default_factory=dict)  # drafter -> per position i: drafts tried
    accepted_at: dict[str, list[int]] = field(default_factory=dict)  # drafter -> per position i: accepted
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    spec_emitted: int = 0  # tokens emitted by speculating steps (accepted + recovered/bonus)

    def observe(self, *, drafter: str, gamma: int, accepted: int, emitted: int, draft_s: float,
                verify_s: float) -> None:
        """One step: ``gamma`` drafted tokens (0: a plain step), ``accepted`` of them kept."""
        key = f"{drafter if gamma else 'none'}/{gamma}"
        self.steps[key] = self.steps.get(key, 0) + 1
        self.draft_s[key] = self.draft_s.get(key, 0.0) + draft_s
        slot = self.pass_s.setdefault(str(gamma + 1), [0.0, 0])
        slot[0] += verify_s
        slot[1] += 1
        if gamma:
            reached = self.reached.setdefault(drafter, [])
            taken = self.accepted_at.setdefault(drafter, [])
            while len(reached) < gamma:
                reached.append(0)
                taken.append(0)
            # Position i was tried if positions < i were all accepted; it was accepted if i <= accepted.
            for i in range(min(accepted + 1, gamma)):
                reached[i] += 1
            for i in range(accepted):
                taken[i] += 1
            self.drafted += gamma
            self.accepted += accepted
            self.spec_steps += 1
            self.spec_emitted += emitted

    def merge(self, other: StepTally) -> None:
        for key, n in other.steps.items():
            self.steps[key] = self.steps.get(key, 0) + n
        for key, s in other.draft_s.items():
            self.draft_s[key] = self.draft_s.get(key, 0.0) + s
        for key, (s, n) in other.pass_s.items():
            slot = self.pass_s.setdefault(key, [0.0, 0])
            slot[0] += s
            slot[1] += n
        for name, counts in other.reached.items():
            for mine, theirs in ((self.reached, counts), (self.accepted_at, other.accepted_at[name])):
                row = mine.setdefault(name, [])
                row.extend([0] * (len(theirs) - len(row)))
                for i, v in enumerate(theirs):
                    row[i] += v
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.spec_steps += other.spec_steps
        self.spec_emitted += other.spec_emitted

    def per_position_acceptance(self, drafter: str) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at.get(drafter, []), self.reached.get(drafter, []))]

    def mean_pass_s(self, n: int) -> float | None:
        total, count = self.pass_s.get(str(n), (0.0, 0))
        return total / count if count else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """τ: tokens emitted per speculating step (bonus/recovered included)."""
        return self.spec_emitted / self.spec_steps if self.spec_steps else None

    def expected_speedup(self, plain_pass_s: float | None) -> float | None:
        """The formula above over this tally's steps; ``plain_pass_s`` is T_target(1) of plain decoding."""
        if plain_pass_s is None or not self.steps:
            return None
        tokens = seconds = 0.0
        for key, count in self.steps.items():
            drafter, gamma = key.rsplit("/", 1)
            g = int(gamma)
            alpha = self.per_position_acceptance(drafter)
            expected, run = 1.0, 1.0
            for i in range(g):
                run *= alpha[i] if i < len(alpha) else 0.0
                expected += run
            target = self.mean_pass_s(g + 1)
            if target is None:
                return None
            tokens += count * expected
            seconds += count * (target + self.draft_s[key] / count)
        return tokens / seconds * plain_pass_s if seconds > 0 else None


@dataclass(slots=True)
class Row:
    """One timed generation of one prompt in one mode."""

    pair: str
    family: str
    category: str
    prompt_id: str
    mode: str
    order: int  # position of this mode in the prompt's rotated mode order
    prompt_tokens: int
    token_ids: list[int]
    wall_s: float  # the whole call, prefill included
    ttft_s: float | None  # until the first generated token
    finish_reason: str | None
    tally: StepTally | None = None  # specchat modes only
    engine_stats: dict[str, Any] | None = None  # the engine's own stats dict (specchat modes only)
    vs_plain: str | None = None  # token equality with specchat plain (greedy): "same", "differs at 12", ...
    vs_hf_plain: str | None = None  # the same against transformers plain
    comparable: bool = True  # every mode produced as many tokens on this prompt

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mismatch(self) -> bool:
        return any(v not in (None, "same") for v in (self.vs_plain, self.vs_hf_plain))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(new_tokens=self.new_tokens, tok_s=self.tok_s, mismatch=self.mismatch)
        if self.tally is not None:
            out["acceptance_rate"] = self.tally.acceptance_rate
            out["mean_accepted_length"] = self.tally.mean_accepted_length
        return out


def compare_tokens(ids: list[int], reference: list[int]) -> str:
    """"same", "differs at I" (first differing index), "stopped early (N vs M)" or "ran longer (N vs M)"."""
    for i, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return f"differs at {i}"
    if len(ids) < len(reference):
        return f"stopped early ({len(ids)} vs {len(reference)} tokens)"
    if len(ids) > len(reference):
        return f"ran longer ({len(ids)} vs {len(reference)} tokens)"
    return "same"


def mark_equality(rows: list[Row], *, greedy: bool) -> None:
    """Fill ``vs_plain``, ``vs_hf_plain`` (greedy only) and ``comparable`` on rows of the same pair/prompt."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.pair, row.prompt_id), []).append(row)
    for group in groups.values():
        by_mode = {r.mode: r for r in group}
        lengths = {r.new_tokens for r in group}
        for row in group:
            row.comparable = len(lengths) == 1 or not greedy
            if not greedy:
                continue
            for attr, ref in (("vs_plain", by_mode.get("plain")), ("vs_hf_plain", by_mode.get("hf-plain"))):
                if ref is not None and ref is not row:
                    setattr(row, attr, compare_tokens(row.token_ids, ref.token_ids))


@dataclass(slots=True)
class Aggregate:
    """One (pair, family, mode) line of the tables."""

    pair: str
    family: str
    mode: str
    prompts: int  # prompts aggregated (comparable ones)
    prompts_total: int
    tokens: int
    wall_s: float
    tok_s: float
    decode_tok_s: float | None  # prefill excluded: Σ(tokens - 1) / Σ(wall - ttft)
    mismatches: int  # rows whose tokens differ from plain or hf-plain (greedy)
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    per_position_acceptance: dict[str, list[float]] | None = None
    x_hf_plain: float | None = None
    match: str | None = None  # the transformers mode this one is compared with
    x_match: float | None = None
    x_plain_measured: float | None = None  # decode tok/s over specchat plain's
    x_plain_expected: float | None = None  # the formula with measured acceptance and pass times


def _matching_mode(mode: str) -> str | None:
    base = mode.split(":", 1)[0]
    return {"plain": "hf-plain", "prompt-lookup": "hf-prompt-lookup", "draft-model": "hf-assisted",
            "auto": "best hf"}.get(base)


def aggregate(rows: list[Row]) -> list[Aggregate]:
    """Per (pair, family, mode) totals and ratios, in first-appearance order."""
    cells: dict[tuple[str, str], dict[str, list[Row]]] = {}
    for row in rows:
        cells.setdefault((row.pair, row.family), {}).setdefault(row.mode, []).append(row)
    result: list[Aggregate] = []
    for (pair, family), modes in cells.items():
        comparable_ids = {r.prompt_id for rs in modes.values() for r in rs if r.comparable}
        all_ids = {r.prompt_id for rs in modes.values() for r in rs}
        use = comparable_ids or all_ids
        aggs: dict[str, Aggregate] = {}
        tallies: dict[str, StepTally] = {}
        for mode, mode_rows in modes.items():
            chosen = [r for r in mode_rows if r.prompt_id in use]
            tokens = sum(r.new_tokens for r in chosen)
            wall = sum(r.wall_s for r in chosen)
            timed = [r for r in chosen if r.ttft_s is not None and r.new_tokens > 1]
            decode_wall = sum(r.wall_s - r.ttft_s for r in timed)
            agg = Aggregate(pair=pair, family=family, mode=mode, prompts=len(chosen), prompts_total=len(mode_rows),
                            tokens=tokens, wall_s=wall, tok_s=tokens / wall if wall > 0 else 0.0,
                            decode_tok_s=(sum(r.new_tokens - 1 for r in timed) / decode_wall
                                          if decode_wall > 0 else None),
                            mismatches=sum(r.mismatch for r in mode_rows))
            if any(r.tally is not None for r in chosen):
                tally = StepTally()
                for r in chosen:
                    if r.tally is not None:
                        tally.merge(r.tally)
                tallies[mode] = tally
                agg.acceptance_rate = tally.acceptance_rate
                agg.mean_accepted_length = tally.mean_accepted_length
                agg.per_position_acceptance = {d: tally.per_position_acceptance(d) for d in tally.reached} or None
            aggs[mode] = agg
        hf = {m: a for m, a in aggs.items() if m.startswith("hf-")}
        best_hf = max(hf, key=lambda m: hf[m].tok_s, default=None)
        plain = aggs.get("plain")
        plain_pass = tallies["plain"].mean_pass_s(1) if "plain" in tallies else None
        for mode, agg in aggs.items():
            if "hf-plain" in aggs and aggs["hf-plain"].tok_s > 0:
                agg.x_hf_plain = agg.tok_s / aggs["hf-plain"].tok_s
            match = _matching_mode(mode)
            if match == "best hf":
                match = best_hf
            if match in aggs and aggs[match].tok_s > 0:
                agg.match, agg.x_match = match, agg.tok_s / aggs[match].tok_s
            if plain is not None and plain.decode_tok_s and agg.decode_tok_s and not mode.startswith("hf-"):
                agg.x_plain_measured = agg.decode_tok_s / plain.decode_tok_s
            if mode in tallies and mode != "plain":
                own = tallies[mode].mean_pass_s(1)
                agg.x_plain_expected = tallies[mode].expected_speedup(plain_pass if plain_pass else own)
            result.append(agg)
    return result
