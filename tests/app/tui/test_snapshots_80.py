"""Snapshot tests at 80x24 (issue 36: layouts regressed silently at the size a newcomer's terminal has): the chat
screen with a reply, the pair picker, the settings, an edit block, and a long reply. Pictures are in
``__snapshots__``; after a deliberate UI change update them with ``--snapshot-update`` and look at them."""

from __future__ import annotations

from app_harness import make_app, ready, reply_done, send, wait_for
from fake_engine import FakeEngineFactory

SIZE = (80, 24)
SPARK = [0, 30, 55, 70, 76, 79, 81, 80, 79, 78, 80, 79]  # the sparkline is timing-dependent: pinned here
EDIT_REPLY = """I changed the greeting:

greet.py
<<<<<<< SEARCH
def greet(name):
    print("hi " + name)
=======
def greet(name: str) -> None:
    print(f"hello {name}")
>>>>>>> REPLACE

The rest of the file stays as it was.
"""
LONG_REPLY = "\n\n".join(
    f"Step {i}: read the file, find the function, change one line, run the tests." for i in range(30)
)


def app_for(tmp_path, **engine):
    return make_app(tmp_path, factory=FakeEngineFactory(wall_s=1.0, **engine))


async def after_reply(pilot, message: str = "Reverse a string in Python") -> None:
    await ready(pilot)
    await send(pilot, message)
    await reply_done(pilot)
    pilot.app.chat.stats_bar.set_samples(SPARK)
    pilot.app.chat.query_one("#prompt").cursor_blink = False  # a blinking cursor would make pictures differ
    await pilot.pause()


def test_snapshot_80_chat_with_a_reply(tmp_path, snap_compare):
    """The reply's code block and its totals line wrap inside 80 columns; the stats bar shows the decode rate,
    acc, τ and "×1.80? vs plain"; the footer keeps F1-F4."""
    assert snap_compare(app_for(tmp_path), terminal_size=SIZE, run_before=after_reply)


def test_snapshot_80_pair_picker(tmp_path, snap_compare):
    """The picker fills the width: pair, drafter, memory, fits and download whole; the description below."""

    async def run_before(pilot) -> None:
        await ready(pilot)
        pilot.app.chat.query_one("#prompt").cursor_blink = False
        pilot.app.chat.stats_bar.show_ready("smollm2-135m")
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(getattr(pilot.app.screen, "info", {})) == 3)
        await pilot.pause()

    assert snap_compare(app_for(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_snapshot_80_settings(tmp_path, snap_compare):
    """The settings dialog (F3) at 80x24: every drafter named with what it needs, chosen for the current pair."""

    async def run_before(pilot) -> None:
        await ready(pilot)
        pilot.app.chat.query_one("#prompt").cursor_blink = False
        pilot.app.chat.stats_bar.show_ready("smollm2-135m")
        await pilot.press("f3")
        await pilot.pause(0.2)

    assert snap_compare(app_for(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_snapshot_80_edit_block(tmp_path, snap_compare, monkeypatch):
    """A SEARCH/REPLACE reply drawn as an edit of greet.py ("✎ greet.py · SEARCH/REPLACE") with its Apply button,
    no heading nor quote made of its markers."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "greet.py").write_text('def greet(name):\n    print("hi " + name)\n', encoding="utf-8")

    async def run_before(pilot) -> None:
        await after_reply(pilot, "make greet typed")
        pilot.app.chat.query_one("EditBlockView").scroll_visible(animate=False)
        await pilot.pause()

    assert snap_compare(app_for(tmp_path, reply=EDIT_REPLY), terminal_size=SIZE, run_before=run_before)


def test_snapshot_80_long_reply(tmp_path, snap_compare):
    """A 30-paragraph reply scrolled to its end: the last steps, the totals line, the input and the stats bar
    in place (nothing pushed off the screen)."""
    assert snap_compare(app_for(tmp_path, reply=LONG_REPLY), terminal_size=SIZE, run_before=after_reply)
