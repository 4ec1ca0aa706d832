"""The live statistics bar (tokens/s, acceptance, τ, γ, drafter and policy state, a tokens/s sparkline) and
the presenters that format statistics for it and for a reply's totals line.

Contract: the bar is updated from the UI thread at most ~10 times a second (once per drained reply buffer);
it also shows model loading progress. Every number is the engine's (:class:`RequestStats`, the same object
`specchat generate --json` prints and the history stores) except the live tokens/s, measured over the last
second by the bridge (``backend``'s tok_s counts the whole reply, prefill included).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from rich.segment import Segment
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import ProgressBar

from specchat.app.tui.bridge import LiveView
from specchat.backend.api import PolicyState, RequestStats

SPARK_SAMPLES = 60
SPARK_WIDTH = 30  # columns; each shows the highest of SPARK_SAMPLES // SPARK_WIDTH samples
SPARK_BARS = "▁▂▃▄▅▆▇█"
FINISH_NOTES = {"cancelled": "stopped", "length": "max tokens reached", "context": "context full",
                "error": "error", "stop": "stop string", "eos": ""}


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def policy_label(live: LiveView) -> str:
    policy = live.stats.last_policy
    if policy is None:
        return ""
    if policy == PolicyState.OFF or live.drafter == "none":
        return "plain decoding"
    if policy == PolicyState.PAUSED:
        return f"{live.drafter}: paused"
    return f"{live.drafter}: speculating"


def reply_totals(stats: RequestStats, finish_reason: str) -> str:
    """One line under a finished reply: tokens, time, tok/s, acceptance, τ, drafter, and how it ended."""
    parts = [f"{stats.new_tokens} tokens", f"{num(stats.wall_s, 2)} s", f"{num(stats.tok_s)} tok/s"]
    if stats.drafted:
        parts.append(f"acceptance {pct(stats.acceptance_rate)}")
        parts.append(f"τ {num(stats.mean_accepted_length, 2)}")
    if stats.drafter:
        parts.append(stats.drafter)
    note = FINISH_NOTES.get(finish_reason, finish_reason)
    if note:
        parts.append(note)
    return " · ".join(parts)


def stored_totals(meta: Mapping[str, Any] | None) -> str:
    """The totals line of a reply reopened from history (its stats column: RequestStats.to_dict() plus
    ``finish_reason``; an older or damaged row shows what can be read of it)."""
    if not meta:
        return ""
    return reply_totals(RequestStats.from_dict(meta), str(meta.get("finish_reason", "")))


def sparkline(samples: list[float], width: int = SPARK_WIDTH) -> Text:
    """Bars scaled to the highest sample; ``width`` columns, each the highest of its share of ``samples``."""
    step = max(1, len(samples) // width)
    columns = [max(samples[i:i + step]) for i in range(0, len(samples), step)][-width:]
    top = max(columns, default=0.0)
    if top <= 0:
        return Text(" " * len(columns))
    last = len(SPARK_BARS) - 1
    return Text("".join(SPARK_BARS[min(last, round(value / top * last))] if value > 0 else " " for value in columns))


class StatsLine(Widget):
    """One line of a fixed size: the statistics on the left, the tokens/s sparkline on the right.

    An update repaints this line only: no layout pass of the whole screen (as ``Static.update`` would do),
    no second region (as Textual's Sparkline widget would be), and the line is drawn straight from Rich
    segments (Textual's Content pipeline took ~1.5 ms a line). It is redrawn up to ten times a second while
    the engine decodes on the same cores, so every millisecond here is taken from decoding.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = Text()
        self.spark = Text()
        self._strip: tuple[int, Strip] | None = None  # (width, the line drawn for it)

    def set(self, text: Text | str, spark: Text | None = None) -> None:
        self.text = Text(text) if isinstance(text, str) else text
        if spark is not None:
            self.spark = spark
        self._strip = None
        self.refresh()

    def line_text(self, width: int) -> Text:
        """The statistics, then the sparkline flush right when ``width`` leaves room for it."""
        gap = width - self.text.cell_len - self.spark.cell_len
        if not self.spark.cell_len or gap < 2:
            return self.text
        spark = self.spark.copy()
        spark.stylize("green")
        return Text.assemble(self.text, " " * gap, spark)

    def render(self) -> Text:  # what the line shows (render_line draws it)
        return self.line_text(self.size.width)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y != 0:
            return Strip.blank(width, self.rich_style)
        if self._strip is None or self._strip[0] != width:
            text = self.line_text(width).copy()
            text.truncate(width)
            segments = list(text.render(self.app.console, end=""))  # one line: no wrapping pass, no newline
            strip = Strip(Segment.apply_style(segments, self.rich_style)).adjust_cell_length(width, self.rich_style)
            self._strip = (width, strip)
        return self._strip[1]


class StatsBar(Horizontal):
    """One line at the bottom: live statistics (or loading progress) and the tokens/s sparkline."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._samples: deque[float] = deque([0.0] * SPARK_SAMPLES, maxlen=SPARK_SAMPLES)
        self.pair_name = ""

    def compose(self) -> ComposeResult:
        yield StatsLine(id="stats-text")
        yield ProgressBar(total=1.0, show_eta=False, show_percentage=True, id="load-progress")

    def on_mount(self) -> None:
        self.query_one("#load-progress").display = False

    def _set(self, text: Text | str, spark: Text | None = None) -> None:
        self.query_one("#stats-text", StatsLine).set(text, spark)

    def set_samples(self, samples: list[float]) -> None:
        """Replace the sparkline's samples (tokens/s, oldest first) and redraw it."""
        self._samples.clear()
        self._samples.extend(samples[-SPARK_SAMPLES:])
        line = self.query_one("#stats-text", StatsLine)
        line.set(line.text, sparkline(list(self._samples)))

    def show_loading(self, pair_name: str, text: str, fraction: float | None) -> None:
        self.pair_name = pair_name
        bar = self.query_one("#load-progress", ProgressBar)
        bar.display = True
        bar.update(total=None if fraction is None else 1.0, progress=fraction or 0.0)
        self._set(Text.assemble(("⟳ ", "bold yellow"), (f"{pair_name}: ", "bold"), text))

    def show_ready(self, pair_name: str, note: str = "ready") -> None:
        self.pair_name = pair_name
        self.query_one("#load-progress").display = False
        self._set(Text.assemble(("● ", "bold green"), (pair_name, "bold"), f"  {note}"))

    def show_unloaded(self, note: str) -> None:
        self.query_one("#load-progress").display = False
        self._set(Text.assemble(("○ ", "bold red"), note))

    def show_live(self, live: LiveView, *, streaming: bool) -> None:
        stats = live.stats
        spark = None
        if streaming:
            self._samples.append(live.window_tok_s or 0.0)
            spark = sparkline(list(self._samples))
        text = Text()
        text.append("● " if streaming else "○ ", style="bold green" if streaming else "dim")
        text.append(self.pair_name, style="bold")
        rate = (live.window_tok_s or stats.tok_s) if streaming else stats.tok_s
        text.append(f"  {num(rate)} tok/s", style="bold cyan")
        text.append(f"  acc {pct(stats.acceptance_rate)}")
        text.append(f"  τ {num(stats.mean_accepted_length, 2)}")
        text.append(f"  γ {'—' if stats.last_gamma is None else stats.last_gamma}")
        label = policy_label(live)
        if label:
            style = {PolicyState.PAUSED: "yellow", PolicyState.SPECULATING: "green"}.get(stats.last_policy, "dim")
            text.append(f"  {label}", style=style)
        if streaming:
            text.append("  esc stop", style="dim")
        self._set(text, spark)
