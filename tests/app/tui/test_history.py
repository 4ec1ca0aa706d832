"""Pilot tests of history: saved while streaming, reopen and continue, rename, delete, export."""

from __future__ import annotations

import time

from app_harness import make_app, notifications, ready, reply_done, send, wait_for
from fake_engine import CANNED_REPLY, FakeEngineFactory
from textual.widgets import DataTable, Input

from specchat.app.tui.screens.dialogs import ConfirmScreen, TextPromptScreen
from specchat.app.tui.screens.history import HistoryScreen
from specchat.app.tui.widgets.message_view import AssistantMessage, UserMessage


async def test_reply_is_saved_while_it_streams(tmp_path):
    app = make_app(tmp_path, factory=FakeEngineFactory(step_delay_s=0.06))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await wait_for(pilot, lambda: app.chat.conv.chat_id is not None and app.engine.started.is_set())
        chat_id = app.chat.conv.chat_id
        deadline = time.monotonic() + 1.0
        saved = ""
        while time.monotonic() < deadline and not saved.strip():
            await pilot.pause(0.05)
            saved = app.store.messages(chat_id)[-1].content
        stored = app.store.messages(chat_id)[-1]
        assert app.chat.generating and saved.strip(), "nothing saved within 1 s of streaming"
        assert not stored.complete and CANNED_REPLY.startswith(stored.content)
        await pilot.press("escape")
        await reply_done(pilot)
        view = app.chat.query_one(AssistantMessage)
        assert app.store.messages(chat_id)[-1].content == view.text  # the final save has all of it


async def test_reopen_a_chat_and_continue_it(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "first question")
        await reply_done(pilot)
        first_chat = app.chat.conv.chat_id
        await pilot.press("ctrl+n")
        assert not app.chat.query(AssistantMessage) and app.chat.conv.chat_id is None
        await pilot.press("f4")
        assert isinstance(app.screen, HistoryScreen)
        table = app.screen.query_one(DataTable)
        assert table.row_count == 1 and str(table.get_row_at(0)[0]).strip() == "first question"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.conv.chat_id == first_chat)
        await pilot.pause()
        assert len(app.chat.query(UserMessage)) == 1
        reply = app.chat.query_one(AssistantMessage)
        assert reply.text == CANNED_REPLY and reply.totals.startswith("79 tokens")
        await send(pilot, "follow-up")
        await reply_done(pilot)
        assert [m["content"] for m in app.engine.requests[-1].messages] == ["first question", CANNED_REPLY, "follow-up"]
        assert len(app.store.messages(first_chat)) == 4 and len(app.store.list_chats()) == 1


async def test_rename_delete_and_export(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_EXPORT_DIR", str(tmp_path / "Documents"))
    (tmp_path / "Documents").mkdir()
    monkeypatch.chdir(tmp_path / "Documents")  # not where it goes: the test names another folder below
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "keep me")
        await reply_done(pilot)
        chat_id = app.chat.conv.chat_id
        await pilot.press("f4")
        history = app.screen
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen))
        app.screen.query_one(Input).value = "Renamed chat"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is history)
        assert app.store.chat(chat_id).title == "Renamed chat"
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen))
        app.screen.query_one(Input).value = str(tmp_path / "out.md")
        await pilot.press("enter")
        await wait_for(pilot, lambda: (tmp_path / "out.md").exists())
        exported = (tmp_path / "out.md").read_text()
        assert "# Renamed chat" in exported and "keep me" in exported and "def reverse" in exported
        await pilot.press("e")  # Enter takes the proposal: the documents folder, the chat's title, a new name
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen))
        proposed = tmp_path / "Documents" / "Renamed-chat.md"
        assert app.screen.query_one(Input).value == str(proposed)
        await pilot.press("enter")
        await wait_for(pilot, lambda: proposed.exists())
        assert f"Chat exported: Exported to {proposed.resolve()}" in notifications(app)  # the whole path said
        await pilot.press("e")  # the next proposal does not replace that file
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen))
        assert app.screen.query_one(Input).value == str(tmp_path / "Documents" / "Renamed-chat-2.md")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is history)
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: app.screen is history and not app.store.list_chats())
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.chat.conv.chat_id is None)  # the open chat was deleted: a new one
        assert not app.chat.query(AssistantMessage)
        assert any("Exported to" in n for n in notifications(app))


async def test_history_write_failure_is_reported_and_the_chat_goes_on(tmp_path):
    from specchat.app.chat.history.records import StoreError
    from specchat.app.chat.history.store import ChatStore

    class BrokenStore(ChatStore):
        def add_message(self, *args, **kwargs):
            raise StoreError("could not save a message in the history /x: disk full.")

    app = make_app(tmp_path, store=BrokenStore(tmp_path / "h.sqlite3"))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await reply_done(pilot)
        assert app.chat.query_one(AssistantMessage).text == CANNED_REPLY
        assert sum("disk full" in n for n in notifications(app)) == 1  # one notice, not one per save
