"""Snapshot tests (pytest-textual-snapshot) of the chat app on the fake engine, with fixed statistics.

Each docstring says what the picture must show. Update the pictures after a deliberate UI change with
``pytest tests/app/tui/test_snapshots.py --snapshot-update`` and look at them (the failure report shows a diff).
"""

from __future__ import annotations

from app_harness import make_app, ready, reply_done, send, wait_for
from fake_engine import FakeEngineFactory

SIZE = (110, 34)
SPARK = [0, 30, 55, 70, 76, 79, 81, 80, 79, 78, 80, 79]  # the sparkline is timing-dependent: pinned here


def snapshot_app(tmp_path, **engine):
    return make_app(tmp_path, factory=FakeEngineFactory(wall_s=1.0, **engine))


async def chat_with_reply(pilot) -> None:
    await ready(pilot)
    await send(pilot, "Reverse a string in Python")
    await reply_done(pilot)
    pilot.app.chat.stats_bar.set_samples(SPARK)
    pilot.app.chat.query_one("#prompt").cursor_blink = False  # a blinking cursor would make pictures differ
    await pilot.pause()


def test_snapshot_finished_reply(tmp_path, snap_compare):
    """The header reads "specchat — smollm2-135m · Reverse a string in Python". Below: the user message, then
    the reply with a syntax-highlighted Python code block and the italic totals line
    "79 tokens · 1.00 s · 78.8 tok/s · acceptance 50% · τ 3.00 · ×1.80 vs plain (expected) · prompt-lookup"
    (the rate after the first token). The stats bar at the bottom shows "78.8 tok/s  acc 50%  τ 3.00  ×1.80? vs
    plain  last reply: prompt-lookup" (no γ nor "speculating" between
    replies) and a rising sparkline; the prompt input (placeholder text) sits between them;
    the footer lists Help, Pair, Settings, History (F1-F4 first), then Regenerate, New chat, Token view,
    Details."""
    assert snap_compare(snapshot_app(tmp_path), terminal_size=SIZE, run_before=chat_with_reply)


def test_snapshot_accepted_token_view(tmp_path, snap_compare):
    """Like the finished reply, but the reply is shown as plain text coloured by token source under the legend
    "Token sources: ■ accepted draft ■ recovered at a rejection ■ bonus ■ plain target": green, yellow and
    magenta runs; the first word ("Here") in the default colour (the prefill token)."""

    async def run_before(pilot) -> None:
        await chat_with_reply(pilot)
        await pilot.press("ctrl+t")
        await pilot.pause()

    assert snap_compare(snapshot_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_snapshot_details_panel(tmp_path, snap_compare):
    """A panel on the right titled "Speculation details", "drafter prompt-lookup · γ 4" and "seed 1234567" (the
    seed replays the reply), four per-position acceptance bars (positions 1-4, falling from 82% to 56%),
    "expected 1.80×", "spec ÷ plain steps 2.27×" (pause_every=3 gives 22 speculating and 10 plain steps, over the
    8 of each it needs), and the counters (79 tokens, 32 steps, 88 drafted, 46 accepted, 52%, τ 3.09, 10 paused
    steps, first token 0.01 s, 79.0 tok/s); the reply's totals line wraps in the narrower conversation."""

    async def run_before(pilot) -> None:
        await chat_with_reply(pilot)
        await pilot.press("ctrl+g")

    assert snap_compare(snapshot_app(tmp_path, pause_every=3), terminal_size=SIZE, run_before=run_before)


def test_snapshot_pair_picker(tmp_path, snap_compare):
    """A modal "Choose a model pair" as wide as the terminal over the dimmed chat: a table with three rows —
    smollm2-135m (marked ●, highlighted, prompt-lookup, 572 MiB, fits yes), big-pair (draft-model, Org/Big-7B,
    16.8 GiB, fits NO, download 14.9 GiB, gated), plain (none, 572 MiB, yes) — every column whole, and below it
    the highlighted pair's description, target, drafter, γ and "needs about 572 MiB, 14.9 GiB free on the
    device" (binary units, as `specchat models`)."""

    async def run_before(pilot) -> None:
        await ready(pilot)
        pilot.app.chat.query_one("#prompt").cursor_blink = False
        pilot.app.chat.stats_bar.show_ready("smollm2-135m")  # without the (timing-dependent) load time
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(getattr(pilot.app.screen, "info", {})) == 3)
        await pilot.pause()

    assert snap_compare(snapshot_app(tmp_path), terminal_size=SIZE, run_before=run_before)
