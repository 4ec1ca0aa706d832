"""The speculation details panel: per-position acceptance as bars, expected vs measured speedup, counters.

Contract: ``update_stats(live, stats)`` is called from the UI thread (≤ ~10 Hz, and once with the final
stats). Per-position acceptance comes from the engine's final ``per_position_acceptance`` when present, else
from the UI's live count. The expected speedup is the engine's ``expected_speedup`` (the policy's formula with
measured inputs; shown only when the engine reports it). The measured speedup is the engine's
``measured_speedup`` when present, else tokens/s of speculative steps over tokens/s of plain steps in the
same reply (known only when the policy paused speculation for some steps).
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from specchat.app.tui.bridge import LiveStats
from specchat.app.tui.widgets.stats_bar import num, pct

BAR_WIDTH = 20


def bar(value: float | None, width: int = BAR_WIDTH) -> Text:
    if value is None:
        return Text("·" * width, style="dim")
    filled = round(max(0.0, min(1.0, value)) * width)
    return Text.assemble(("█" * filled, "green"), ("░" * (width - filled), "dim"))


def measured_speedup(live: LiveStats, stats: dict[str, Any] | None) -> float | None:
    if stats and isinstance(stats.get("measured_speedup"), (int, float)):
        return float(stats["measured_speedup"])
    if live.spec_tok_s and live.plain_tok_s:
        return live.spec_tok_s / live.plain_tok_s
    return None


def render_details(live: LiveStats, stats: dict[str, Any] | None) -> Text:
    stats = stats or {}
    text = Text("Speculation details\n", style="bold")
    text.append(f"drafter {live.drafter or stats.get('drafter', '—')} · γ {live.gamma}\n\n", style="dim")
    positions = stats.get("per_position_acceptance") or live.per_position_acceptance
    text.append("Per-position acceptance\n", style="bold")
    if not positions:
        text.append("  no drafts verified yet\n", style="dim")
    for i, rate in enumerate(positions):
        text.append(f" {i + 1:>2} ")
        text.append_text(bar(rate if isinstance(rate, (int, float)) else None))
        text.append(f" {pct(rate if isinstance(rate, (int, float)) else None):>4}\n")
    expected = stats.get("expected_speedup")
    text.append("\nSpeedup\n", style="bold")
    text.append(f"  expected {num(expected, 2) + '×' if isinstance(expected, (int, float)) else '—'}\n")
    measured = measured_speedup(live, stats)
    text.append(f"  measured {num(measured, 2) + '×' if measured is not None else '—'}\n")
    if measured is None:
        text.append("  (needs plain steps in the reply; `specchat bench` measures it)\n", style="dim")
    text.append("\nCounters\n", style="bold")
    for label, value in (
        ("tokens", str(live.new_tokens)),
        ("steps", str(live.steps)),
        ("drafted", str(live.drafted)),
        ("accepted", str(live.accepted)),
        ("acceptance", pct(live.acceptance_rate)),
        ("τ (tokens/step)", num(live.mean_accepted_length, 2)),
        ("paused steps", str(live.paused_steps)),
        ("first token", f"{num(live.ttft_s, 2)} s"),
        ("tok/s (reply)", num(live.tok_s_avg)),
    ):
        text.append(f"  {label:<16}{value:>8}\n")
    return text


class DetailsPanel(Static):
    """Shown beside the conversation (Ctrl+G)."""

    def on_mount(self) -> None:
        self.update_stats(LiveStats(), None)

    def update_stats(self, live: LiveStats, stats: dict[str, Any] | None) -> None:
        self.update(render_details(live, stats))
