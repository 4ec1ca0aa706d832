"""Pilot tests of /edit (diff shown, applied only after confirmation, backup kept) and /file."""

from __future__ import annotations

from app_harness import make_app, notifications, ready, reply_done, send, wait_for
from fake_engine import FakeEngineFactory
from textual.widgets import Static

from specchat.app.tui.screens.chat_actions import split_path_argument
from specchat.app.tui.screens.dialogs import DiffScreen
from specchat.app.tui.widgets.message_view import UserMessage

ORIGINAL = "def answer():\n    return 1\n"
EDITED_REPLY = "Here you go:\n\n```python\ndef answer():\n    return 42\n```\n\nI changed the value.\n"


def edit_app(tmp_path):
    return make_app(tmp_path, factory=FakeEngineFactory(reply=EDITED_REPLY))


async def test_edit_shows_a_diff_and_applies_after_confirmation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "answer.py").write_text(ORIGINAL)
    app = edit_app(tmp_path)
    async with app.run_test(size=(120, 45)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit answer.py")
        chip = app.chat.query_one("#attachments", Static)
        assert chip.display and "editing answer.py" in str(chip.render())
        await send(pilot, "return 42 instead")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), what="the diff")
        diff = app.screen.diff
        assert "-    return 1" in diff and "+    return 42" in diff
        content = app.engine.requests[0].messages[-1]["content"]
        assert "return 42 instead" in content and ORIGINAL in content
        shown = app.chat.query_one(UserMessage).display_text
        assert "edit answer.py" in shown and "return 42 instead" in shown and "def answer" not in shown
        await pilot.press("a")
        await wait_for(pilot, lambda: (tmp_path / "answer.py").read_text() != ORIGINAL)
        assert (tmp_path / "answer.py").read_text() == "def answer():\n    return 42\n"
        backups = list(tmp_path.glob("answer.py.specchat-bak-*"))
        assert len(backups) == 1 and backups[0].read_text() == ORIGINAL
        assert any("Edit applied" in n for n in notifications(app))
        assert not chip.display


async def test_edit_cancelled_leaves_the_file_and_can_be_reviewed_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "answer.py").write_text(ORIGINAL)
    app = edit_app(tmp_path)
    async with app.run_test(size=(120, 45)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit answer.py return 42 instead")  # the request after the path: sent at once
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, DiffScreen))
        assert (tmp_path / "answer.py").read_text() == ORIGINAL and not list(tmp_path.glob("*.specchat-bak-*"))
        app.chat.action_review_edit()
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen))
        await pilot.click("#apply")
        await wait_for(pilot, lambda: (tmp_path / "answer.py").read_text() != ORIGINAL)


async def test_file_context_and_attachment_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("the secret word is banana\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit missing.py")
        assert "no such file" in notifications(app)[-1]
        assert app.chat.query_one("#prompt").text == "/edit missing.py"  # kept, to fix the path
        await send(pilot, "/file blob.bin")
        assert "binary" in notifications(app)[-1]
        await send(pilot, "/edit")
        assert "needs a file path" in notifications(app)[-1]
        assert not app.engine.requests
        assert split_path_argument('"my notes.txt" what is it?') == ("my notes.txt", "what is it?")
        assert split_path_argument("notes.txt what is it?") == ("notes.txt", "what is it?")
        (tmp_path / "with space.txt").write_text("x\n")
        assert split_path_argument("with space.txt") == ("with space.txt", "")
        await send(pilot, "/file notes.txt")
        assert "📎 notes.txt" in str(app.chat.query_one("#attachments", Static).render())
        await send(pilot, "what is the secret word?")
        await reply_done(pilot)
        content = app.engine.requests[0].messages[-1]["content"]
        assert "the secret word is banana" in content and content.endswith("what is the secret word?")
        assert not isinstance(app.screen, DiffScreen)  # /file never offers an edit
        stored = app.store.messages(app.chat.conv.chat_id)[0]
        assert stored.stats["attachments"] == ["notes.txt"] and stored.stats["request"] == "what is the secret word?"
        await send(pilot, "/file notes.txt")
        await send(pilot, "/drop")
        assert not app.chat.query_one("#attachments", Static).display
