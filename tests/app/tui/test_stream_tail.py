"""The streaming tail of a reply: which blocks are finished, how the tail draws the unfinished end, and that
most redraws of a streaming reply repaint the tail instead of laying out the screen."""

from __future__ import annotations

from app_harness import make_app, ready, reply_done, send, wait_for
from fake_engine import FakeEngineFactory

from specchat.app.tui.screens import reply_controller as chat_module
from specchat.app.tui.widgets.message_view import AssistantMessage, ChatMarkdown, CopyableFence
from specchat.app.tui.widgets.stream_tail import RESERVE_LINES, StreamTail, reserved_height, split_finished


def test_split_finished_keeps_the_last_block_open():
    assert split_finished("") == 0
    assert split_finished("Half a paragr") == 0
    assert split_finished("One.\n\nTwo") == len("One.\n\n")
    assert split_finished("Intro:\n\n```python\ndef f():\n") == len("Intro:\n\n")  # an open fence stays open
    assert split_finished("```python\nx = 1\n```\n\nAfter") == len("```python\nx = 1\n```\n\n")
    assert split_finished("- a\n- b\n- c") == 0  # a list is one block until something follows it
    text = "# Title\n\nPara one.\n\n- item\n\nLast"
    assert text[: split_finished(text)] == "# Title\n\nPara one.\n\n- item\n\n"


def test_reserved_height_grows_in_whole_steps():
    assert reserved_height(0) == RESERVE_LINES
    assert reserved_height(RESERVE_LINES) == RESERVE_LINES
    assert reserved_height(RESERVE_LINES + 1) == 2 * RESERVE_LINES


CODE = "\n".join(f"value_{i} = {i} * {i}" for i in range(40))
LONG_REPLY = f"Here are the squares:\n\n```python\n{CODE}\n```\n\nThat is **all** of them.\n"


async def test_a_streaming_code_block_repaints_the_tail_and_ends_highlighted(tmp_path, monkeypatch):
    """Mid-reply the open fence is plain code in the tail (no fence widget yet); most redraws repaint the tail
    alone; at the end the Markdown widget holds the whole reply, its code block a highlighted fence."""
    monkeypatch.setattr(chat_module, "TEXT_INTERVAL_S", (0.05, 0.05))
    monkeypatch.setattr(chat_module, "UI_CPU_BUDGET", 1.0)  # keep the intervals where they start
    app = make_app(tmp_path, factory=FakeEngineFactory(reply=LONG_REPLY, step_delay_s=0.03))
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "squares")
        view = app.chat.query_one(AssistantMessage)
        tail = view.query_one(StreamTail)
        await wait_for(pilot, lambda: "value_12 =" in tail.markdown, what="the code block half streamed")
        assert app.chat.generating and tail.display
        drawn = [tail.render_line(y).text for y in range(tail.size.height)]
        # the paragraph moved to the Markdown widget or is drawn above; the open fence is plain code, indented
        # as Textual's MarkdownFence draws it, not yet a (highlighted) fence widget
        assert any(line.startswith("  value_3 = 3 * 3") for line in drawn), drawn
        assert not view.query(CopyableFence)
        assert tail.size.height % RESERVE_LINES == 0
        await reply_done(pilot)
        assert not tail.display and view.text == LONG_REPLY
        assert view.query_one("#body", ChatMarkdown).source == LONG_REPLY  # all of it, once, in the Markdown
        assert view.code_blocks() == [CODE]
        # ~45 text redraws of a reply growing to ~50 lines: most were repaints of the tail alone
        assert tail.repaints > 2 * tail.relayouts > 0, (tail.repaints, tail.relayouts)
