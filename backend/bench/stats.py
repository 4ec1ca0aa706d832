"""Rows, token-equality checks and per-family aggregates of `specchat bench`. Pure Python: no torch.

A :class:`Row` is one (prompt, mode) generation, timed by the bench itself around the whole call, prefill
included, the same way for specchat and transformers. Specchat rows also carry the
:class:`~specchat.backend.speculative.stats.StepCounts` the engine counted (drafted/accepted per position,
target pass times T(n), draft times), from which the expected speedup is computed with measured inputs:

    expected ×plain = T_plain(1) · Σ_steps E[N](γ_s) / Σ_steps (T_draft(γ_s) + T_target(γ_s + 1))
    E[N](γ) = 1 + Σ_{i=1..γ} Π_{j<=i} α_j        (α_j: measured acceptance of draft position j)

summed over the steps the mode actually took (paused steps count as γ = 0), so adaptive γ is covered. It
leaves out per-step bookkeeping, so "measured ×plain" below it shows what overheads cost.

Aggregates are totals, not means of ratios: tok/s = Σ tokens / Σ seconds over a family's prompts. When
modes stopped at different lengths on a prompt (greedy runs only), that prompt is left out of the family's
aggregates ("not comparable") as long as at least one comparable prompt remains, and the count is reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from specchat.backend.api import RequestStats
from specchat.backend.speculative.stats import StepCounts


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
    tally: StepCounts | None = None  # specchat modes only
    engine_stats: RequestStats | None = None  # the engine's own statistics (specchat modes only)
    vs_plain: str | None = None  # token equality with specchat plain (greedy): "same", "differs at 12", ...
    vs_hf_plain: str | None = None  # the same against transformers plain
    comparable: bool = True  # every mode produced as many tokens on this prompt
    repeat: int = 0  # which of the run's repeats (bench --repeats) this row belongs to
    reported_tokens: int | None = None  # a remote server's count when it sent no token ids (token_ids empty)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids) or (self.reported_tokens or 0)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mismatch(self) -> bool:
        return any(v not in (None, "same") for v in (self.vs_plain, self.vs_hf_plain))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, tally=None, engine_stats=None))
        out["tally"] = self.tally.to_dict() if self.tally is not None else None
        out["engine_stats"] = self.engine_stats.to_dict() if self.engine_stats is not None else None
        out.update(new_tokens=self.new_tokens, tok_s=self.tok_s, mismatch=self.mismatch)
        if self.tally is not None:
            out["acceptance_rate"] = self.tally.acceptance_rate
            out["mean_accepted_length"] = self.tally.mean_accepted_length
        return out


def compare_tokens(ids: list[int], reference: list[int]) -> str:
    """ "same", "differs at I" (first differing index), "stopped early (N vs M)" or "ran longer (N vs M)"."""
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
        # llama.cpp computes the same model with other arithmetic: its modes are checked against its own plain
        # decoding, and their lengths do not decide whether specchat's and transformers' rows are comparable.
        lengths = {r.new_tokens for r in group if not _is_llamacpp(r.mode)}
        lengths_llamacpp = {r.new_tokens for r in group if _is_llamacpp(r.mode)}
        for row in group:
            llamacpp = _is_llamacpp(row.mode)
            row.comparable = len(lengths_llamacpp if llamacpp else lengths) == 1 or not greedy
            if not greedy:
                continue
            own_plain = "llama-server" if row.mode.startswith("llama-server") else "llamacpp-plain"
            refs = (
                (("vs_plain", by_mode.get(own_plain)),)
                if llamacpp
                else (("vs_plain", by_mode.get("plain")), ("vs_hf_plain", by_mode.get("hf-plain")))
            )
            for attr, ref in refs:
                if ref is not None and ref is not row:
                    setattr(row, attr, compare_tokens(row.token_ids, ref.token_ids))


def _is_llamacpp(mode: str) -> bool:
    """llama.cpp's modes (in-process or its server): checked against their own plain decoding."""
    return mode.startswith(("llamacpp-", "llama-server"))


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
    mismatches: int  # rows whose tokens differ from plain or hf-plain (llama.cpp's: from llamacpp-plain; greedy)
    ttft_s: float | None = None  # mean time to the first token
    tok_s_min: float | None = None  # the lowest and highest tok/s of one repeat's rows (None with one repeat)
    tok_s_max: float | None = None
    x_llamacpp_plain: float | None = None  # tok/s over llama.cpp plain decoding's, same prompts
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    per_position_acceptance: dict[str, list[float | None]] | None = None
    x_hf_plain: float | None = None
    match: str | None = None  # the transformers mode this one is compared with
    x_match: float | None = None
    x_plain_measured: float | None = None  # decode tok/s over specchat plain's
    x_plain_expected: float | None = None  # the formula with measured acceptance and pass times


def _spread(rows: list[Row]) -> tuple[float | None, float | None]:
    """(min, max) over repeats of each repeat's tok/s (its tokens / its seconds); None with one repeat."""
    repeats: dict[int, list[Row]] = {}
    for row in rows:
        repeats.setdefault(row.repeat, []).append(row)
    if len(repeats) < 2:
        return None, None
    rates = [sum(r.new_tokens for r in rs) / max(sum(r.wall_s for r in rs), 1e-9) for rs in repeats.values()]
    return min(rates), max(rates)


def _matching_mode(mode: str) -> str | None:
    base = mode.split(":", 1)[0]
    return {
        "plain": "hf-plain",
        "prompt-lookup": "hf-prompt-lookup",
        "draft-model": "hf-assisted",
        "auto": "best hf",
    }.get(base)


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
        tallies: dict[str, StepCounts] = {}
        for mode, mode_rows in modes.items():
            chosen = [r for r in mode_rows if r.prompt_id in use]
            tokens = sum(r.new_tokens for r in chosen)
            wall = sum(r.wall_s for r in chosen)
            # (row, its time to first token) for the rows that have one and a decode phase after it
            timed = [(r, r.ttft_s) for r in chosen if r.ttft_s is not None and r.new_tokens > 1]
            decode_wall = sum(r.wall_s - ttft for r, ttft in timed)
            agg = Aggregate(
                pair=pair,
                family=family,
                mode=mode,
                prompts=len(chosen),
                prompts_total=len(mode_rows),
                tokens=tokens,
                wall_s=wall,
                tok_s=tokens / wall if wall > 0 else 0.0,
                decode_tok_s=(sum(r.new_tokens - 1 for r, _ in timed) / decode_wall if decode_wall > 0 else None),
                mismatches=sum(r.mismatch for r in mode_rows),
                ttft_s=(sum(ttft for _, ttft in timed) / len(timed)) if timed else None,
            )
            agg.tok_s_min, agg.tok_s_max = _spread(chosen)
            if any(r.tally is not None for r in chosen):
                tally = StepCounts()
                for r in chosen:
                    if r.tally is not None:
                        tally.merge(r.tally)
                tallies[mode] = tally
                agg.acceptance_rate = tally.acceptance_rate
                agg.mean_accepted_length = tally.mean_accepted_length
                agg.per_position_acceptance = {d: tally.per_position_acceptance(d) for d in tally.reached} or None
            else:  # another engine's own counts (llama-server's timings), where it reports them
                drafted = sum(r.engine_stats.drafted or 0 for r in chosen if r.engine_stats is not None)
                accepted = sum(r.engine_stats.accepted or 0 for r in chosen if r.engine_stats is not None)
                agg.acceptance_rate = accepted / drafted if drafted else None
            aggs[mode] = agg
        hf = {m: a for m, a in aggs.items() if m.startswith("hf-")}
        best_hf = max(hf, key=lambda m: hf[m].tok_s, default=None)
        plain = aggs.get("plain")
        plain_pass = tallies["plain"].mean_pass_s(1) if "plain" in tallies else None
        for mode, agg in aggs.items():
            if "hf-plain" in aggs and aggs["hf-plain"].tok_s > 0:
                agg.x_hf_plain = agg.tok_s / aggs["hf-plain"].tok_s
            if "llamacpp-plain" in aggs and aggs["llamacpp-plain"].tok_s > 0:
                agg.x_llamacpp_plain = agg.tok_s / aggs["llamacpp-plain"].tok_s
            match = _matching_mode(mode)
            if match == "best hf":
                match = best_hf
            if match in aggs and aggs[match].tok_s > 0:
                agg.match, agg.x_match = match, agg.tok_s / aggs[match].tok_s
            if (
                plain is not None
                and plain.decode_tok_s
                and agg.decode_tok_s
                and not mode.startswith("hf-")
                and not _is_llamacpp(mode)
            ):
                agg.x_plain_measured = agg.decode_tok_s / plain.decode_tok_s
            if mode in tallies and mode != "plain":
                own = tallies[mode].mean_pass_s(1)
                agg.x_plain_expected = tallies[mode].expected_speedup(plain_pass if plain_pass else own)
            result.append(agg)
    return result
