"""Pilot tests of issue 36 ("the newcomer's second hour"), on the fake engine: each point a new user met in the
chat UI, checked on what the screen shows (``screen_text``) at 80x24 unless said otherwise."""

from __future__ import annotations

from app_harness import make_app, ready, reply_done, screen_text, send, wait_for
from fake_engine import FakeEngineFactory, fake_pair_info
from textual.widgets import Button, RadioButton
from textual.widgets._toast import Toast

from specchat.app.chat.settings import load_settings
from specchat.app.tui.app import NOTIFY_MAX_S
from specchat.app.tui.screens.dialogs import DiffScreen
from specchat.app.tui.screens.settings_screen import SettingsScreen
from specchat.app.tui.widgets.edit_block import EditBlockView
from specchat.app.tui.widgets.message_view import AssistantMessage
from specchat.app.tui.widgets.stream_tail import StreamTail
from specchat.backend.limits import DRAFTERS


async def test_notifications_stand_clear_of_the_input_and_the_statistics(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await ready(pilot)
        chat = app.chat
        chat.notify("A long error that wraps over several lines " * 6, title="Reply failed", severity="error")
        chat.notify("A warning", severity="warning", timeout=60)
        await wait_for(pilot, lambda: len(list(app.screen.query(Toast))) == 2, what="two toasts")
        await pilot.pause()
        for toast in app.screen.query(Toast):
            for widget in (chat.prompt, chat.stats_bar, chat.query_one("Footer")):
                assert not toast.region.overlaps(widget.region), (toast.region, widget.region)
            assert toast.region.y >= 1  # under the header
        # however long a caller asks for, a toast lasts at most its severity's limit
        timeouts = {n.severity: n.timeout for n in app._notifications}
        assert timeouts == {"error": NOTIFY_MAX_S["error"], "warning": NOTIFY_MAX_S["warning"]}
        assert NOTIFY_MAX_S["information"] <= 5


async def test_notifications_show_file_names_as_typed_never_as_markup(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await ready(pilot)
        # /file with a name holding markup: the chat screen's error notification (Widget.notify: markup=True)
        app.chat.prompt.text = "/file [b]missing[/b].txt"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "[b]missing[/b].txt" in screen_text(app), what="the name as typed")
        assert all(not n.markup for n in app._notifications)
        app.chat.stats_bar.notify("[red]x[/red] from a widget", title="[i]title[/i]")
        await wait_for(pilot, lambda: "[red]x[/red] from a widget" in screen_text(app), what="a widget's toast")
        assert "[i]title[/i]" in screen_text(app)


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


async def test_a_search_replace_reply_shows_as_an_edit_of_its_file_with_an_apply_action(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "greet.py").write_text('def greet(name):\n    print("hi " + name)\n', encoding="utf-8")
    app = make_app(tmp_path, factory=FakeEngineFactory(reply=EDIT_REPLY))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "make greet typed")  # a plain question: the reply's blocks still name their file
        await reply_done(pilot)
        reply = app.chat.query_one(AssistantMessage)
        block = reply.query_one(EditBlockView)
        assert block.file_name == "greet.py" and block.closed
        # no heading made of the line above "=======", no quote made of ">>>>>>> REPLACE"
        assert not reply.query("MarkdownH1, MarkdownH2, MarkdownBlockQuote")
        reply.scroll_visible(animate=False)
        block.scroll_visible(animate=False)
        await pilot.pause()
        text = screen_text(app)
        assert "✎ greet.py · SEARCH/REPLACE" in text and "Apply" in text
        assert '    print(f"hello {name}")' in text and ">>>>>>> REPLACE" in text
        await pilot.click(block.query_one(Button))
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), what="the diff dialog")
        assert '+    print(f"hello {name}")' in app.screen.diff
        await pilot.press("a")
        await wait_for(pilot, lambda: "hello" in (tmp_path / "greet.py").read_text(), what="the file written")
        assert (tmp_path / "greet.py").read_text() == 'def greet(name: str) -> None:\n    print(f"hello {name}")\n'


async def test_a_search_replace_block_streams_as_an_edit_block_too(tmp_path):
    factory = FakeEngineFactory(reply=EDIT_REPLY, step_delay_s=0.05)
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "make greet typed")
        tail = app.chat.query_one(StreamTail)
        await wait_for(pilot, lambda: "=======" in tail.markdown or app.chat.query(EditBlockView), what="the divider")
        if "=======" in tail.markdown:  # drawn in the tail while it streams: the header, never a heading
            assert "✎ greet.py · SEARCH/REPLACE" in screen_text(app)
        await reply_done(pilot)
        assert len(app.chat.query(EditBlockView)) == 1


async def test_the_drafter_is_chosen_per_pair_from_every_drafter_with_what_it_needs(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
        screen = app.screen
        buttons = {b.id.removeprefix("drafter-"): b for b in screen.query(RadioButton)}
        assert set(DRAFTERS) | {"pair"} == set(buttons)  # every drafter of backend/limits.py, auto included
        assert buttons["pair"].value and not buttons["auto"].disabled
        assert buttons["draft-model"].disabled  # the embedded pair has no draft model, and it says so
        assert "needs a draft model; smollm2-135m has none" in buttons["draft-model"].label.plain
        screen.query_one("#drafter").focus()  # scrolls the list into view in a 24-line terminal
        await pilot.pause()
        assert "Drafter for smollm2-135m (kept for this pair only)" in screen_text(app)
        buttons["suffix"].value = True
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat, what="the settings saved")
        assert app.settings.drafters == {"smollm2-135m": "suffix"}
        await send(pilot, "one")
        await reply_done(pilot)
        assert app.engine.requests[-1].drafter == "suffix"

        await app.switch_pair("big-pair")  # another pair keeps its own drafter
        await wait_for(pilot, lambda: app.current_pair_name == "big-pair" and app.engine is not None)
        await send(pilot, "two")
        await reply_done(pilot)
        assert app.engine.requests[-1].drafter is None
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
        big = {b.id.removeprefix("drafter-"): b for b in app.screen.query(RadioButton)}
        assert big["pair"].value and not big["suffix"].value and not big["draft-model"].disabled

    again = make_app(tmp_path)  # kept in the file, per pair
    assert again.settings.drafter_for("smollm2-135m") == "suffix" and again.settings.drafter_for("big-pair") == "pair"


def test_an_older_settings_files_one_drafter_is_kept_for_its_last_pair_only(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text('{"drafter": "suffix", "last_pair": "plain"}')
    settings, warning = load_settings(path)
    assert warning is None and settings.drafters == {"plain": "suffix"}
    assert settings.request_drafter("plain") == "suffix" and settings.request_drafter("smollm2-135m") is None
    path.write_text('{"drafter": "suffix"}')  # no pair to keep it for: dropped rather than applied to every pair
    assert load_settings(path)[0].drafters == {}


async def test_the_picker_says_which_pair_is_expected_to_be_slower_here(tmp_path):
    def pair_info(pair):
        slower = (
            "expected slower than plain decoding on CPU: its nf4 draft (bitsandbytes) ..."
            if pair.drafter == "draft-model"
            else None
        )
        return {**fake_pair_info(pair), "slower": slower}

    app = make_app(tmp_path, pair_info=pair_info)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(getattr(app.screen, "info", {})) == 3, what="estimates")
        await pilot.pause()
        rows = [row.strip("│ ●") for row in screen_text(app).splitlines() if "B  " in row]  # the table's rows
        slow = [row.split()[0] for row in rows if "▼" in row]
        assert slow == [n for n, p in app.pairs.items() if p.drafter == "draft-model"], rows  # seen in the table
        assert slow == [n for n, p in app.pairs.items() if p.drafter == "draft-model"], rows  # seen in the table
        table = app.screen.query_one("#pairs")
        table.move_cursor(row=list(app.pairs).index(slow[0]))
        await pilot.pause()
        assert "▼ expected slower than plain decoding on CPU" in screen_text(app)


async def test_loading_progress_moves_while_a_step_reports_nothing(tmp_path):
    factory = FakeEngineFactory()
    factory.release.clear()  # the load reaches its last percentage, then sits there (a draft being quantised)
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(80, 24)) as pilot:
        line = lambda: str(app.chat.query_one("#stats-text").render())  # noqa: E731
        await wait_for(pilot, lambda: "100%" in line(), what="the last percentage")
        first = line()
        await pilot.pause(0.6)
        assert line() != first and line()[0] != first[0]  # the spinner and the time move
        await wait_for(pilot, lambda: "still working" in line(), what="the quiet step named", timeout=6)
        assert "since the last report" in line()
        factory.release.set()
        await ready(pilot)
