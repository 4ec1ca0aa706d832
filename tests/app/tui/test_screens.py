"""Pilot tests of the modal screens: pair picker, settings (validated, persisted), theme, help, palette."""

from __future__ import annotations

import json

from app_harness import make_app, notifications, ready, reply_done, send, wait_for
from fake_engine import FakeEngineFactory
from textual.widgets import DataTable, Input, RadioButton, Select, Static, TextArea

from specchat.app.tui.screens.dialogs import ConfirmScreen
from specchat.app.tui.screens.help import HelpScreen
from specchat.app.tui.screens.picker import PairPickerScreen
from specchat.app.tui.screens.settings_screen import SettingsScreen
from specchat.app.tui.widgets.message_view import AssistantMessage


async def test_picker_lists_pairs_and_switches_keeping_the_conversation(tmp_path):
    factory = FakeEngineFactory()
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(130, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await reply_done(pilot)
        first_engine = app.engine
        await pilot.press("f2")
        picker = app.screen
        assert isinstance(picker, PairPickerScreen)
        table = picker.query_one(DataTable)
        await wait_for(pilot, lambda: len(picker.info) == 3, what="pair estimates")
        assert table.row_count == 3
        assert list(map(str, table.get_row("big-pair")[3:])) == ["16.8 GiB", "NO", "14.9 GiB", "gated"]
        assert list(map(str, table.get_row("plain")[1:5])) == ["none", "packaged:fake-target", "572 MiB", "yes"]
        assert "embedded default" in str(picker.query_one("#pair-description", Static).render())
        await pilot.press("down", "down", "enter")  # "plain": no download, fits: no question asked
        await wait_for(pilot, lambda: app.current_pair_name == "plain" and app.engine is not None)
        assert factory.calls == ["smollm2-135m", "plain"] and first_engine.closed
        assert len(app.chat.query(AssistantMessage)) == 1  # the conversation is kept
        await send(pilot, "again")
        await reply_done(pilot)
        warm, reply = app.engine.requests  # the new engine first read the chat into its cache (screens/warmer.py)
        assert [m["role"] for m in warm.messages] == ["user", "assistant"] and warm.sampling.max_new_tokens == 1
        assert warm.conversation == reply.conversation == app.chat.conv.key  # the reply goes on from that cache
        assert [m["role"] for m in reply.messages] == ["user", "assistant", "user"]
        assert app.store.chat(app.chat.conv.chat_id).pair == "smollm2-135m, plain"  # the pairs that wrote it


async def test_picker_asks_before_a_download_and_a_pair_that_does_not_fit(tmp_path):
    factory = FakeEngineFactory()
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(130, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        picker = app.screen
        await wait_for(pilot, lambda: len(picker.info) == 3)
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        body = str(app.screen.query_one(".dialog-body", Static).render())
        assert "download of 14.9 GiB" in body and "gated" in body
        await pilot.press("escape")  # declined: nothing loads
        await wait_for(pilot, lambda: app.screen is picker)
        assert factory.calls == ["smollm2-135m"]
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(
            pilot,
            lambda: (
                isinstance(app.screen, ConfirmScreen)
                and "16.8 GiB" in str(app.screen.query_one(".dialog-body", Static).render())
            ),
        )
        await pilot.press("y")
        await wait_for(pilot, lambda: factory.calls == ["smollm2-135m", "big-pair"] and app.engine is not None)
        assert app.current_pair_name == "big-pair"


async def test_settings_are_validated_persisted_and_used(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(130, 45)) as pilot:
        await ready(pilot)
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#temperature", Input).value = "11"
        await pilot.press("ctrl+s")
        assert app.screen is screen  # refused: stays open
        assert "temperature" in str(screen.query_one("#settings-error", Static).render())
        assert screen.query_one("#temperature", Input).has_class("-invalid")
        screen.query_one("#temperature", Input).value = "0.5"
        screen.query_one("#top_k", Input).value = "40"
        screen.query_one("#max_new_tokens", Input).value = "64"
        screen.query_one("#drafter-none", RadioButton).value = True
        screen.query_one("#gamma_mode", Select).value = "fixed"
        screen.query_one("#gamma", Input).value = "x"
        await pilot.press("ctrl+s")
        assert app.screen is screen and "whole number" in str(screen.query_one("#settings-error", Static).render())
        screen.query_one("#gamma", Input).value = "3"
        screen.query_one("#system_prompt", TextArea).text = "Be brief."
        await pilot.press("ctrl+s")
        assert app.screen is not screen
        saved = json.loads((tmp_path / "settings.json").read_text())
        assert saved["temperature"] == 0.5 and saved["top_k"] == 40 and saved["max_new_tokens"] == 64
        assert (
            saved["drafters"] == {"smollm2-135m": "none"}
            and saved["gamma"] == 3
            and saved["system_prompt"] == "Be brief."
        )
        await send(pilot, "hi")
        await reply_done(pilot)
        request = app.engine.requests[0]
        assert request.sampling.temperature == 0.5 and request.sampling.top_k == 40
        assert request.sampling.top_p is None and request.sampling.max_new_tokens == 64
        assert request.drafter == "none" and request.gamma == 3
        assert request.messages[0] == {"role": "system", "content": "Be brief."}
        assert "max tokens reached" in app.chat.query_one(AssistantMessage).totals

    again = make_app(tmp_path)  # a new run reads them back
    assert again.settings.temperature == 0.5 and again.settings.gamma == 3
    assert again.settings.last_pair == "smollm2-135m"


async def test_corrupt_settings_fall_back_to_defaults_and_the_theme_is_remembered(tmp_path):
    (tmp_path / "settings.json").write_text("{not json")
    app = make_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert any("is not valid JSON" in n and "using the defaults" in n for n in notifications(app))
        assert app.settings.max_new_tokens == 1024
        app.theme = "nord"
        await pilot.pause()
    saved = json.loads((tmp_path / "settings.json").read_text())  # rewritten whole and valid
    assert saved["theme"] == "nord" and saved["last_pair"] == "smollm2-135m"
    again = make_app(tmp_path)
    async with again.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert again.theme == "nord" and not notifications(again)


async def test_help_and_command_palette(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        from specchat.app.tui.screens.help import HELP as text

        assert app.screen.query_one("#help-text").display
        assert "Ctrl+J" in text and "acceptance rate" in text.lower() and "τ" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        app.chat.query_one("#conversation").focus()
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        titles = {command.title for command in app.get_system_commands(app.screen)}
        assert {
            "New chat",
            "Chat history",
            "Model pair",
            "Settings",
            "Regenerate",
            "Stop",
            "Accepted-token view",
            "Details panel",
            "Copy last reply",
            "Export chat",
            "Theme",
        } <= titles
        await send(pilot, "hi")
        await reply_done(pilot)
        await pilot.press("ctrl+p", *"Regen")
        first_match = lambda: str(app.screen.query_one("CommandList").get_option_at_index(0).prompt)  # noqa: E731
        await wait_for(pilot, lambda: "Regenerate" in first_match(), what="the palette to find Regenerate")
        await pilot.press("enter")  # an async action run from the palette
        await wait_for(pilot, lambda: len(app.engine.requests) == 2, what="regenerate from the palette")
        await reply_done(pilot)
