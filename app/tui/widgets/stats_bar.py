"""The live statistics bar (tokens/s, acceptance, τ, γ, drafter and step state, a tokens/s sparkline) and
the presenters that format statistics for it and for a reply's totals line.

Contract: the bar is updated from the UI thread at most ~10 times a second (once per drained reply buffer).
Every number is the engine's (:class:`RequestStats`, the same object `specchat generate --json` prints and
the history stores) except the live tokens/s, measured over the last second by the bridge. Rates are shown
apart (``speed.py``): the decode rate (tokens after the first over the time after it: ``backend``'s tok_s
counts the whole reply, prefill included) and, after a reply whose prompt took a second or more to read, the
prefill rate; beside τ, the speed-up against plain decoding on this machine ("×1.42 vs plain"; "×1.3?" when it
is the γ policy's expectation rather than this reply's measured steps). Labels say what the latest step did
while a reply streams (speculating with γ drafted, no draft found, paused, plain decoding) and, between
replies, what the last reply did ("last reply: ..."): never "speculating" while idle.

While a reply reads its prompt (an engine that reports prefill progress), the bar says "reading prompt
2,300 / 4,936 tokens", a percentage bar and the time so far. While a pair loads it shows the loader's current
step (its name, a percentage bar when the loader gives a fraction, the step's time and the total); a line too
long for the terminal wraps onto a second line rather than being cut. :class:`LoadSteps` keeps each step's
time for the "ready" note.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rich.segment import Segment
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.strip import Strip
from textual.widget import Widget

from specchat.app.tui.bridge import LiveView
from specchat.app.tui.widgets.load_steps import QUIET_S, SPINNER, LoadSteps, short_step
from specchat.app.tui.widgets.speed import (
    SLOW_PREFILL_S,
    decode_rate,
    prefill_rate,
    rates_text,
    speedup,
    speedup_text,
)
from specchat.backend.api import PolicyState, RequestStats

if TYPE_CHECKING:
    from textual.timer import Timer

SPARK_SAMPLES = 60
SPARK_WIDTH = 30  # columns; each shows the highest of SPARK_SAMPLES // SPARK_WIDTH samples
SPARK_BARS = "▁▂▃▄▅▆▇█"
FINISH_NOTES = {
    "cancelled": "stopped",
    "length": "max tokens reached",
    "context": "context full",
    "error": "error",
    "stop": "stop string",
    "eos": "",
}
# the live line's colour for the latest step's policy state (others, and no state yet: dim)
POLICY_STYLES: dict[PolicyState | None, str] = {PolicyState.PAUSED: "yellow", PolicyState.SPECULATING: "green"}
BAR_CELLS = 12  # the width of a percentage bar (loading, reading a prompt)
# What τ is, wherever it is shown (RequestStats.mean_accepted_length: one definition for the UI, JSON and serve).
TAU_MEANING = (
    "τ: tokens per speculating step = (accepted drafts + 1 per speculating step) ÷ speculating steps; "
    "plain steps are not counted (plain decoding has no τ)"
)
ACCEPTANCE_MEANING = "acc: accepted ÷ drafted (drafts past the reply's end, at EOS or a stop, are discarded)"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def policy_label(live: LiveView) -> str:
    """What the latest step of a streaming reply did."""
    policy, drafter = live.stats.last_policy, live.drafter
    if policy is None:
        return ""
    if policy == PolicyState.OFF or drafter == "none":
        return "plain decoding"
    if policy == PolicyState.PAUSED:
        return f"{drafter}: paused (it did not pay)"
    if policy == PolicyState.NO_DRAFT:
        return f"{drafter}: no draft this step"
    if policy == PolicyState.SPECULATING:
        return f"{drafter}: speculating" if live.stats.last_gamma else f"{drafter}: no draft this step"
    return f"{drafter}: {getattr(policy, 'value', policy)}"


def percent_bar(fraction: float, cells: int = BAR_CELLS) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * cells)
    return "█" * filled + "░" * (cells - filled)


def seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 60 else f"{int(value // 60)} min {int(value % 60):02d} s"


def prefill_line(done: int, total: int, elapsed: float | None = None) -> str:
    """ "reading prompt 2,300 / 4,936 tokens 47%" (and the time so far)."""
    fraction = done / total if total else 0.0
    line = f"reading prompt {done:,} / {total:,} tokens {fraction * 100:.0f}%"
    return line if elapsed is None else f"{line} · {seconds(elapsed)}"


def reply_totals(
    stats: RequestStats,
    finish_reason: str,
    error: str | None = None,
    prefill: tuple[int, int] | None = None,
    elapsed_s: float | None = None,
) -> str:
    """One line under a finished reply: tokens, time, the decode rate (and the prefill's, when the prompt took
    long to read), acceptance, τ, the speed-up against plain decoding, drafter, and how it ended (for an error,
    what went wrong and what the user can do). A reply stopped before its first token says how much of the prompt
    was read (``prefill``: tokens read, tokens to read; ``elapsed_s``: the time it ran)."""
    if finish_reason == "cancelled" and not stats.new_tokens:
        read = f" ({prefill[0]:,} of {prefill[1]:,} tokens)" if prefill is not None else ""
        return f"stopped during prefill{read}" + (f" · {seconds(elapsed_s)}" if elapsed_s is not None else "")
    tokens = f"{stats.new_tokens} tokens" if stats.tokens_counted else "— tokens"  # a server that reported none
    parts = [tokens, f"{num(stats.wall_s, 2)} s", rates_text(stats)]
    if stats.drafted:
        parts.append(f"acceptance {pct(stats.acceptance_rate)}")
        parts.append(f"τ {num(stats.mean_accepted_length, 2)}")
    gain = speedup_text(stats)
    if gain:
        parts.append(gain)
    if stats.accepted_prediction_tokens is not None:
        parts.append(prediction_label(stats))
    if stats.drafter:
        parts.append("plain decoding" if stats.drafter == "none" else stats.drafter)
    note = FINISH_NOTES.get(finish_reason, finish_reason)
    if finish_reason == "error":
        note = f"error: {(error or 'unknown').rstrip('.')} · ↑ edits your message, Ctrl+R retries"
    if note:
        parts.append(note)
    return " · ".join(parts)


def prediction_label(stats: RequestStats) -> str:
    """How much of a prediction (a whole-file /edit's file) the reply kept: its tokens accepted and rejected."""
    return f"prediction {stats.accepted_prediction_tokens} ✓ {stats.rejected_prediction_tokens} ✗"


def stored_totals(meta: Mapping[str, Any] | None) -> str:
    """The totals line of a reply reopened from history (its stats column: RequestStats.to_dict() plus
    ``finish_reason``; an older or damaged row shows what can be read of it)."""
    if not meta:
        return ""
    error = meta.get("error")
    return reply_totals(
        RequestStats.from_dict(meta), str(meta.get("finish_reason", "")), error if isinstance(error, str) else None
    )


def sparkline(samples: list[float], width: int = SPARK_WIDTH) -> Text:
    """Bars scaled to the highest sample; ``width`` columns, each the highest of its share of ``samples``."""
    step = max(1, len(samples) // width)
    columns = [max(samples[i : i + step]) for i in range(0, len(samples), step)][-width:]
    top = max(columns, default=0.0)
    if top <= 0:
        return Text(" " * len(columns))
    last = len(SPARK_BARS) - 1
    return Text("".join(SPARK_BARS[min(last, round(value / top * last))] if value > 0 else " " for value in columns))


class StatsLine(Widget):
    """The statistics on the left, the tokens/s sparkline on the right: one line, or two when the text needs
    them (a long loader message on a narrow terminal: wrapped, never cut).

    An update repaints this widget only: no layout pass of the whole screen (as ``Static.update`` would do),
    unless the number of lines changes; no second region (as Textual's Sparkline widget would be); the line is drawn
    straight from Rich segments (Textual's Content pipeline costs far more a line: ``benchmarks/RESULTS.md``, "Figures
    moved out of the code"). It is redrawn up to ten times a second while the engine decodes on the same cores, so
    every millisecond here is taken from decoding.
    """

    MAX_LINES = 2

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = Text()
        self.spark = Text()
        self._lines: tuple[int, list[Strip]] | None = None  # (width, the lines drawn for it)
        self._line_count = 1

    def set(self, text: Text | str, spark: Text | None = None) -> None:
        self.text = Text(text) if isinstance(text, str) else text
        if spark is not None:
            self.spark = spark
        self._lines = None
        width = self.size.width
        count = (
            1
            if not width or self.text.cell_len <= width
            else min(self.MAX_LINES, len(self.text.wrap(self.app.console, width)))
        )
        if count != self._line_count:
            self._line_count = count
            self.styles.height = count  # a layout pass only when the number of lines changes
        self.refresh()

    def on_resize(self) -> None:
        self.set(self.text)

    def line_text(self, width: int) -> Text:
        """The statistics, then the sparkline flush right when ``width`` leaves room for it."""
        gap = width - self.text.cell_len - self.spark.cell_len
        if not self.spark.cell_len or gap < 2:
            return self.text
        spark = self.spark.copy()
        spark.stylize("green")
        return Text.assemble(self.text, " " * gap, spark)

    def render(self) -> Text:  # what the widget shows (render_line draws it)
        return self.line_text(self.size.width)

    def _draw(self, width: int) -> list[Strip]:
        text = self.line_text(width)
        lines = [text] if text.cell_len <= width else list(text.wrap(self.app.console, width))[: self.MAX_LINES]
        strips = []
        for line in lines:
            line = line.copy()
            line.truncate(width)
            segments = list(line.render(self.app.console, end=""))  # one line: no wrapping pass, no newline
            strips.append(
                Strip(Segment.apply_style(segments, self.rich_style)).adjust_cell_length(width, self.rich_style)
            )
        return strips

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self._lines is None or self._lines[0] != width:
            self._lines = (width, self._draw(width))
        lines = self._lines[1]
        return lines[y] if y < len(lines) else Strip.blank(width, self.rich_style)


class StatsBar(Horizontal):
    """The bottom line: live statistics, a prompt being read, or loading progress, and the sparkline."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._samples: deque[float] = deque([0.0] * SPARK_SAMPLES, maxlen=SPARK_SAMPLES)
        self.pair_name = ""
        self.path = ""  # the forward path in a few words (path_label), shown after the pair's name
        self.load: LoadSteps | None = None
        self._ticker: Timer | None = None

    def compose(self) -> ComposeResult:
        yield StatsLine(id="stats-text")

    def _set(self, text: Text | str, spark: Text | None = None) -> None:
        self.query_one("#stats-text", StatsLine).set(text, spark)

    def set_samples(self, samples: list[float]) -> None:
        """Replace the sparkline's samples (tokens/s, oldest first) and redraw it."""
        self._samples.clear()
        self._samples.extend(samples[-SPARK_SAMPLES:])
        line = self.query_one("#stats-text", StatsLine)
        line.set(line.text, sparkline(list(self._samples)))

    # -- loading -----------------------------------------------------------------------------------------------
    def start_loading(self, pair_name: str, clock: Callable[[], float] = time.monotonic) -> None:
        """A load begins: its steps are timed from now; the line ticks every 0.5 s until it ends."""
        self.pair_name, self.load = pair_name, LoadSteps(clock)
        self.load.report("starting", None)
        if self._ticker is None:
            self._ticker = self.set_interval(0.5, self._draw_loading)
        self._draw_loading()

    def show_loading(self, pair_name: str, text: str, fraction: float | None) -> None:
        if self.load is None or self.pair_name != pair_name:
            self.start_loading(pair_name)
        if self.load is not None:
            self.load.report(text, fraction)
        self._draw_loading()

    def _draw_loading(self) -> None:
        load = self.load
        if load is None:
            return
        spin = SPINNER[int(load.total() * 2) % len(SPINNER)]  # moves at each tick, even while a step is silent
        text = Text.assemble((f"{spin} ", "bold yellow"), (self.pair_name, "bold"), " · ", load.message)
        if load.fraction is not None:
            text.append(f"  {percent_bar(load.fraction)} {load.fraction * 100:3.0f}%", style="cyan")
            if load.quiet_s() >= QUIET_S:  # a step that reports no fraction inside (quantising a draft)
                text.append(f" still working, {seconds(load.quiet_s())} since the last report", style="yellow")
        elapsed = f"  {seconds(load.step_elapsed())}"
        if len(load.steps) > 1:
            elapsed += f" (total {seconds(load.total())})"
        text.append(elapsed, style="dim")
        self._set(text, Text())

    def _stop_loading(self) -> str:
        """End the load display; the steps and their times ("" when there was no load)."""
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        load, self.load = self.load, None
        if load is None:
            return ""
        skip = ("starting", "Models loaded")
        steps = [(short_step(n), d) for n, d in load.durations() if n not in skip and d >= 0.05]
        return ", ".join(f"{name} {seconds(d)}" for name, d in steps)

    def show_ready(self, pair_name: str, note: str = "ready") -> None:
        self.pair_name = pair_name
        steps = self._stop_loading()
        text = Text.assemble(("● ", "bold green"), (pair_name, "bold"), f"  {note}")
        if steps:
            text.append(f" · {steps}", style="dim")
        self._set(text)

    def set_path(self, start_line: str | None) -> bool:
        """Show the path ``start_line`` (``Engine.start_line``) names; True when it changed from a shown one (the
        CPU kernels built in the background took over)."""
        label = path_label(start_line)
        changed = bool(self.path) and label != self.path
        self.path = label
        return changed

    def show_unloaded(self, note: str) -> None:
        self._stop_loading()
        self._set(Text.assemble(("○ ", "bold red"), note))

    def show_note(self, text: Text) -> None:
        """A line of its own after the pair's name (the chat warmer's progress and outcome)."""
        self._set(Text.assemble(("◌ ", "bold cyan"), (self.pair_name, "bold"), "  ", text))

    # -- replies ----------------------------------------------------------------------------------------------
    def show_live(self, live: LiveView, *, streaming: bool) -> None:
        stats = live.stats
        spark = None
        if streaming:
            self._samples.append(live.window_tok_s or 0.0)
            spark = sparkline(list(self._samples))
        text = Text()
        text.append("● " if streaming else "○ ", style="bold green" if streaming else "dim")
        text.append(self.pair_name, style="bold")
        if self.path:
            text.append(f" · {self.path}", style="dim")
        if not streaming and live.prefill is not None and not stats.new_tokens:
            done, total, _ = live.prefill
            text.append(f"  stopped during prefill ({done:,} of {total:,} tokens)", style="dim")
            self._set(text, spark)
            return
        if streaming and live.prefill is not None and not stats.new_tokens:
            done, total, started = live.prefill
            text.append(f"  {prefill_line(done, total)}", style="bold cyan")
            text.append(f" {percent_bar(done / total if total else 0.0)}", style="cyan")
            text.append(f"  {seconds(max(0.0, time.monotonic() - started))}", style="dim")
            text.append("  esc stop", style="dim")
            self._set(text, spark)
            return
        decode = decode_rate(stats)
        rate = (live.window_tok_s or decode or stats.tok_s) if streaming else (decode or stats.tok_s)
        self.tooltip = f"{ACCEPTANCE_MEANING}\n{TAU_MEANING}"
        text.append(f"  {num(rate)} tok/s", style="bold cyan")
        read = prefill_rate(stats)
        if not streaming and read is not None and (stats.prefill_s or 0.0) >= SLOW_PREFILL_S:
            text.append(f"  prefill {read:,.0f} tok/s", style="cyan")
        text.append(f"  acc {pct(stats.acceptance_rate)}")
        text.append(f"  τ {num(stats.mean_accepted_length, 2)}")
        found = speedup(stats)
        if found is not None:  # beside τ: whether those tokens per step paid, on this machine
            value, measured = found
            label = f"  ×{value:.2f}{'' if measured else '?'} vs plain"
            text.append(label, style="green" if value >= 1.0 else "yellow")
        if stats.accepted_prediction_tokens is not None:
            text.append(f"  {prediction_label(stats)}", style="magenta")
        if streaming:
            text.append(f"  γ {'—' if stats.last_gamma is None else stats.last_gamma}")
            label = policy_label(live)
            if label:
                style = POLICY_STYLES.get(stats.last_policy, "dim")
                text.append(f"  {label}", style=style)
            text.append("  esc stop", style="dim")
        elif stats.steps or stats.new_tokens:
            drafter = stats.drafter if stats.drafter and stats.drafter != "none" else "plain decoding"
            text.append(f"  last reply: {drafter}", style="dim")
        self._set(text, spark)


def path_label(start_line: str | None) -> str:
    """A start line in a few words for the bar: "CPU native (avx2)", "CPU int4 Python loop · kernels building"."""
    if not start_line:
        return ""
    label = start_line.split(":")[0].split(",")[0].split(";")[0]
    return f"{label} · kernels building" if "being built in the background" in start_line else label
