"""Presenting `specchat bench` results: rich tables, the JSON file and the PNG chart.

Only formats what :mod:`bench_stats` computed from this run's rows; nothing here measures or invents numbers.
Files written to the output directory: ``bench.json`` (meta, per-run warm-up and estimate, every row and
every aggregate), ``bench.txt`` (the tables as text) and ``speedup.png`` (speedup over transformers plain
per family and mode; hatched bars are modes whose tokens differed from plain decoding).
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specchat.backend.bench.stats import Aggregate, Row, aggregate

OVERALL = "all families"
TITLE_CHARS = 120  # a panel title wraps at this many characters (8-point text across a 12-inch panel)


def aggregate_with_overall(rows: list[Row]) -> list[Aggregate]:
    """Per-family aggregates, then per pair an overall line set over every family (when there are several)."""
    aggs = aggregate(rows)
    for pair in dict.fromkeys(r.pair for r in rows):
        pair_rows = [r for r in rows if r.pair == pair]
        if len({r.family for r in pair_rows}) > 1:
            aggs += aggregate([replace(r, family=OVERALL) for r in pair_rows])
    return aggs


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "–" if value is None or math.isnan(value) else f"{value:{fmt}}{suffix}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "–"
    style = "green" if value >= 1.0 else "red"
    return f"[{style}]{value:.2f}×[/{style}]"


def build_tables(aggs: list[Aggregate], *, greedy: bool) -> list[Table]:
    tables = []
    groups: dict[tuple[str, str], list[Aggregate]] = {}
    for agg in aggs:
        groups.setdefault((agg.pair, agg.family), []).append(agg)
    for (pair, family), lines in groups.items():
        used, total = lines[0].prompts, lines[0].prompts_total
        note = f"{used}/{total} prompts" + ("" if used == total else " (the others not comparable: lengths differ)")
        table = Table(title=escape(f"{pair} · {family} · {note}"), title_justify="left")
        table.add_column("mode", no_wrap=True)
        llamacpp = any(a.x_llamacpp_plain is not None for a in lines)
        for header, justify in (
            ("tokens", "right"),
            ("tok/s", "right"),
            ("spread", "right"),
            ("ttft s", "right"),
            *((("×llama.cpp", "right"),) if llamacpp else ()),
            ("×hf-plain", "right"),
            ("×matching hf", "right"),
            ("accept", "right"),
            ("τ", "right"),
            ("exp ×plain", "right"),
            ("meas ×plain", "right"),
            ("tokens = plain/hf" if greedy else "tokens", "left"),
        ):
            table.add_column(header, justify=justify)
        for a in lines:
            matching = "–" if a.x_match is None or a.match == a.mode else f"{_ratio(a.x_match)} {escape(a.match or '')}"
            if not greedy:
                check = "sampled: not compared"
            elif a.mismatches:
                check = f"[red]{a.mismatches}/{a.prompts_total} differ[/red]"
            else:
                check = "ok"
            spread = "–" if a.tok_s_min is None or a.tok_s_max is None else f"{a.tok_s_min:.1f}–{a.tok_s_max:.1f}"
            table.add_row(
                escape(a.mode),
                str(a.tokens),
                _num(a.tok_s, ".1f"),
                spread,
                _num(a.ttft_s, ".2f"),
                *((_ratio(a.x_llamacpp_plain),) if llamacpp else ()),
                _ratio(a.x_hf_plain),
                matching,
                _num(None if a.acceptance_rate is None else 100 * a.acceptance_rate, ".0f", "%"),
                _num(a.mean_accepted_length, ".2f"),
                _num(a.x_plain_expected, ".2f", "×"),
                _num(a.x_plain_measured, ".2f", "×"),
                check,
            )
        tables.append(table)
    return tables


def notes(rows: list[Row], *, greedy: bool) -> list[str]:
    """One line per row whose tokens differ, and per prompt whose modes stopped at different lengths."""
    lines = []
    if greedy:
        for r in rows:
            if r.mismatch:
                parts = [
                    f"{label}: {v}"
                    for label, v in (("vs plain", r.vs_plain), ("vs hf-plain", r.vs_hf_plain))
                    if v not in (None, "same")
                ]
                lines.append(f"{r.pair} {r.family} {r.prompt_id} [{r.mode}] tokens differ: " + "; ".join(parts))
        seen = set()
        for r in rows:
            if not r.comparable and (r.pair, r.prompt_id) not in seen:
                seen.add((r.pair, r.prompt_id))
                counts = {x.mode: x.new_tokens for x in rows if (x.pair, x.prompt_id) == (r.pair, r.prompt_id)}
                lines.append(
                    f"{r.pair} {r.family} {r.prompt_id}: not comparable, modes produced different "
                    f"token counts {counts}; left out of the family's ratios"
                )
    return lines


def print_report(console: Console, aggs: list[Aggregate], rows: list[Row], *, greedy: bool) -> None:
    for table in build_tables(aggs, greedy=greedy):
        console.print(table)
    console.print(
        "tok/s: total tokens / total seconds, prefill included, per family; spread: the lowest and highest "
        "tok/s of one repeat (--repeats): ratios inside it are noise; ttft s: mean time to the first "
        "token; ×llama.cpp: tok/s over llama.cpp plain on the same GGUF (its modes are checked against its own "
        "plain decoding). ×matching hf: plain↔hf-plain, "
        "prompt-lookup↔hf-prompt-lookup, draft-model↔hf-assisted, auto↔the fastest transformers mode. "
        "exp ×plain: the engine II formula from measured per-position acceptance and target pass times T(n); "
        "meas ×plain: measured decode tok/s (prefill excluded) over specchat plain."
    )
    for line in notes(rows, greedy=greedy):
        console.print(f"[yellow]note:[/yellow] {escape(line)}", highlight=False)


def write_json(
    path: Path, *, meta: dict[str, Any], runs: list[dict[str, Any]], rows: list[Row], aggs: list[Aggregate]
) -> None:
    payload = {"meta": meta, "runs": runs, "aggregates": [asdict(a) for a in aggs], "rows": [r.to_dict() for r in rows]}
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


def write_chart(path: Path, aggs: list[Aggregate]) -> None:
    """Grouped bars: speedup over transformers plain (over specchat plain when the run had no hf-plain),
    one panel per pair, one group per family."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in threads and on servers
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pairs = list(dict.fromkeys(a.pair for a in aggs))
    # One colour per mode name across every panel, so a mode looks the same for every pair.
    palette = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(dict.fromkeys(a.mode for a in aggs))}
    fig, axes = plt.subplots(len(pairs), 1, figsize=(12, 4.2 * len(pairs)), squeeze=False)
    for ax, pair in zip(axes[:, 0], pairs):
        mine = [a for a in aggs if a.pair == pair]
        baseline = "hf-plain" if any(a.mode == "hf-plain" for a in mine) else "plain"
        base = {a.family: a.tok_s for a in mine if a.mode == baseline}
        lines = [a for a in mine if a.mode != baseline and base.get(a.family)]
        hatched, top = False, 1.0
        families = list(dict.fromkeys(a.family for a in mine))
        modes = list(dict.fromkeys(a.mode for a in lines))
        width = 0.8 / max(len(modes), 1)
        for m, mode in enumerate(modes):
            for f, family in enumerate(families):
                agg = next((a for a in lines if a.mode == mode and a.family == family), None)
                if agg is None:
                    continue
                ratio = agg.tok_s / base[family]
                top = max(top, ratio)
                x = f - 0.4 + width * (m + 0.5)
                hatched = hatched or bool(agg.mismatches)
                ax.bar(
                    x,
                    ratio,
                    width,
                    color=palette[mode],
                    hatch="//" if agg.mismatches else None,
                    edgecolor="black",
                    linewidth=0.4,
                    label=mode if agg is next(a for a in lines if a.mode == mode) else None,
                )
                ax.text(x, ratio, f"{ratio:.2f}×\n{agg.tok_s:.1f}", ha="center", va="bottom", fontsize=5.5)
        ax.set_ylim(0, top * 1.25)  # room above the tallest bar for its two-line label (it was cut off, issue 36)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(families)), families, rotation=15)
        who = "transformers plain" if baseline == "hf-plain" else "specchat plain"
        ax.set_ylabel(f"tok/s over {who}")
        title = (
            f"{pair}: speedup over {who} (labels: × and absolute tok/s; {who} "
            + ", ".join(f"{f} {base[f]:.1f}" for f in families if base.get(f))
            + " tok/s)"
        )
        ax.set_title(textwrap.fill(title, TITLE_CHARS), fontsize=8)  # a long title wraps instead of running off
        if modes:
            handles, _ = ax.get_legend_handles_labels()
            if hatched:  # an entry for hatching only when a bar is hatched
                handles.append(
                    Patch(facecolor="white", edgecolor="black", hatch="//", label="tokens differ from plain")
                )
            ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.15)  # the legend beside the axes is kept whole
    plt.close(fig)
