"""The speculation details panel: per-position acceptance as bars, expected vs measured speedup, counters.

Contract: ``update_stats(live)`` is called from the UI thread (≤ ~10 Hz while a reply streams, and once at its
end). Every figure is the engine's (:class:`~specchat.backend.api.RequestStats`): per-position acceptance,
the expected speedup (the γ policy's formula with measured inputs; shown when the engine reports it), and the
step-speed ratio: tokens/s of speculating steps over tokens/s of plain steps in the same reply, shown only when the
reply had at least ``MIN_STEPS`` of each (a handful of steps at other points of the reply — a plain step is often a
calibration step, or one at a longer context — can show a gain at almost no acceptance: ``benchmarks/RESULTS.md``,
"Figures moved out of the code"). It is not the reply's speed-up: `specchat bench` measures that against plain
decoding of the same prompt.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from specchat.app.tui.bridge import LiveView
from specchat.app.tui.widgets.speed import MIN_STEPS, measured_speedup, step_counts
from specchat.app.tui.widgets.stats_bar import num, pct
from specchat.backend.api import RequestStats

BAR_WIDTH = 20
# The counts' definitions (RequestStats) in short for a 38-column panel; the stats bar's tooltip has them in full.
TAU_NOTE = "τ = (accepted + 1 per step) ÷ speculating steps"
DISCARDED_NOTE = "discarded: accepted drafts past the end (EOS, stop string, length)"


def bar(value: float | None, width: int = BAR_WIDTH) -> Text:
    if value is None:
        return Text("·" * width, style="dim")
    filled = round(max(0.0, min(1.0, value)) * width)
    return Text.assemble(("█" * filled, "green"), ("░" * (width - filled), "dim"))


def count(value: int | None) -> str:
    """A counter, or "—" when the engine (a remote server) does not report it."""
    return "—" if value is None else str(value)


def tree_line(stats: RequestStats) -> str:
    """The latest tree draft (the suffix drafter, a draft head): its size and shape, and the branch the target
    followed."""
    shape = (
        f"tree {stats.tree_nodes} node{'s' if stats.tree_nodes != 1 else ''} · depth {stats.tree_depth} · "
        f"{stats.tree_width} branch{'es' if stats.tree_width != 1 else ''}"
    )
    if not stats.tree_accepted:
        return f"{shape}; no branch matched"
    return f"{shape}; followed branch {stats.tree_branch} for {stats.tree_accepted} token" + (
        "s" if stats.tree_accepted != 1 else ""
    )


def render_details(live: LiveView) -> Text:
    stats = live.stats
    text = Text("Speculation details\n", style="bold")
    text.append(f"drafter {live.drafter or stats.drafter or '—'} · γ {count(stats.last_gamma)}\n", style="dim")
    if stats.seed is not None:  # the same request with this seed replays the reply (`generate --seed`)
        text.append(f"seed {stats.seed}\n", style="dim")
    if stats.tree_nodes:
        text.append(tree_line(stats) + "\n", style="dim")
    text.append("\n")
    positions = stats.per_position_acceptance
    # A tree's positions are its depths: the acceptance at depth i of the path the target followed.
    text.append("Per-depth acceptance\n" if stats.tree_nodes else "Per-position acceptance\n", style="bold")
    if not positions:
        text.append("  no drafts verified yet\n", style="dim")
    for i, rate in enumerate(positions):
        text.append(f" {i + 1:>2} ")
        text.append_text(bar(rate))
        text.append(f" {pct(rate):>4}\n")
    expected = stats.expected_speedup
    text.append("\nSpeedup\n", style="bold")
    text.append(f"  expected {num(expected, 2) + '×' if expected is not None else '—'}\n")
    measured = measured_speedup(stats)
    speculating, plain = step_counts(stats)
    text.append(f"  spec ÷ plain steps {num(measured, 2) + '×' if measured is not None else '—'}\n")
    if measured is None:
        text.append(
            f"  (needs {MIN_STEPS} of each; this reply: {speculating} speculating, {plain} plain; "
            "`specchat bench` measures the speed-up)\n",
            style="dim",
        )
    text.append("\nCounters\n", style="bold")
    for label, value in (
        ("tokens", str(stats.new_tokens) if stats.tokens_counted else "—"),
        ("steps", count(stats.steps)),
        ("drafted", count(stats.drafted)),
        ("accepted", count(stats.accepted)),
        ("rejected", count(stats.rejected)),
        ("discarded", count(stats.discarded)),
        ("acceptance", pct(stats.acceptance_rate)),
        ("τ (spec steps)", num(stats.mean_accepted_length, 2)),
        ("paused steps", count(stats.spec_paused_steps)),
        ("first token", f"{num(stats.ttft_s, 2)} s"),
        ("tok/s (reply)", num(stats.tok_s)),
    ):
        text.append(f"  {label:<16}{value:>8}\n")
    text.append(f"\n{TAU_NOTE}\n{DISCARDED_NOTE}\n", style="dim")
    return text


class DetailsPanel(Static):
    """Shown beside the conversation (Ctrl+G)."""

    def on_mount(self) -> None:
        self.update_stats(LiveView())

    def update_stats(self, live: LiveView) -> None:
        self.update(render_details(live))
