"""Pilot tests of issue 19 ("the first hour as a user lives it"), on the fake engine: what a newcomer saw go
wrong, each checked on the screen text a user reads (``screen_text``) at 80x24 or 120x40."""

from __future__ import annotations

import re
import threading
import time

from app_harness import make_app, notifications, ready, reply_done, screen_text, send, wait_for
from fake_engine import FakeEngineFactory, FakePair, fake_pairs

from specchat.app.tui.screens.help import HelpScreen
from specchat.app.tui.screens.history import HistoryScreen
from specchat.app.tui.screens.settings_screen import SettingsScreen
from specchat.app.tui.widgets.message_view import AssistantMessage, UserMessage
from specchat.backend.errors import SpecchatError

PASTE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\nwhat do these do?"


async def test_pasted_code_keeps_its_line_breaks(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, PASTE)
        await reply_done(pilot)
        rows = [row.strip(" ▌▐▎▊│┃") for row in screen_text(app).splitlines()]
        start = rows.index("def area(w, h):")  # a row of its own, as pasted (Markdown joined them into one)
        assert rows[start + 1] == "return w * h" and rows[start + 4] == "def perimeter(w, h):"
        assert app.chat.query_one(UserMessage).content == PASTE


async def test_a_long_prompt_shows_prefill_progress_within_a_second_and_esc_stops_it(tmp_path):
    factory = FakeEngineFactory(prefill_passes=10, prefill_tokens=4936, prefill_delay_s=0.4)
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        sent = time.monotonic()
        await send(pilot, "x " * 2500)
        await wait_for(pilot, lambda: "reading prompt" in screen_text(app), timeout=5, what="prefill progress")
        # The engine reports before its first pass, so this is the UI's own latency: well under 1 s on an idle
        # machine (the tmux check on the real model measures it); 2 s leaves room for a loaded CI runner.
        assert time.monotonic() - sent < 2.0
        assert app.engine.requests[0].prefill_progress
        reply = app.chat.query_one(AssistantMessage)
        moved = re.compile(r"reading prompt [1-9][\d,]* / 4,936 tokens \d+%")
        await wait_for(
            pilot, lambda: moved.search(screen_text(app)) and moved.match(reply.totals), timeout=10, what="a pass read"
        )
        assert "Esc stops" in reply.totals and re.search(r"tokens \d+% · \d+\.\d s", reply.totals)
        await pilot.press("escape")
        await reply_done(pilot)
        assert re.fullmatch(r"stopped during prefill \([\d,]+ of 4,936 tokens\) · \d+\.\d s", reply.totals)
        assert app.engine.requests[0] and not app.engine.active.is_set()


async def test_start_up_names_each_step_with_a_percentage_and_its_time(tmp_path):
    gate = threading.Event()

    class StepLoader(FakeEngineFactory):
        def __call__(self, pair, progress, confirm_download):
            progress("Hashing SmolLM2-135M-Instruct-Q4_1.gguf", 0.42)
            progress("Reading the tokenizer from SmolLM2-135M-Instruct-Q4_1.gguf (first start only)", None)
            started = time.monotonic()
            gate.wait(10)
            time.sleep(max(0.1, 1.3 - (time.monotonic() - started)))  # the step lasts 1.x s however fast the test
            return super().__call__(pair, progress, confirm_download)

    app = make_app(tmp_path, factory=StepLoader())
    async with app.run_test(size=(80, 24)) as pilot:
        bar = app.chat.stats_bar
        await wait_for(pilot, lambda: bar.load is not None and len(bar.load.steps) >= 3, what="two loader steps")
        await pilot.pause(0.6)  # the ticker redraws the time
        text = " ".join(screen_text(app).split())
        assert "Reading the tokenizer from SmolLM2-135M-Instruct-Q4_1.gguf (first start only)" in text  # wrapped
        assert "--%" not in text and " s (total " in text
        gate.set()
        await ready(pilot)
        await pilot.pause()
        ready_line = " ".join(screen_text(app).split())
        assert "smollm2-135m ready in" in ready_line and "Reading the tokenizer 1." in ready_line
    steps = [name for name, _ in bar.load.steps] if bar.load else []
    assert not steps  # the load display ended with the load


async def test_a_step_with_a_fraction_shows_a_real_percentage_bar(tmp_path):
    gate = threading.Event()

    class Hashing(FakeEngineFactory):
        def __call__(self, pair, progress, confirm_download):
            progress("Hashing model.gguf", 0.42)
            gate.wait(10)
            return super().__call__(pair, progress, confirm_download)

    app = make_app(tmp_path, factory=Hashing())
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: "Hashing model.gguf" in screen_text(app), what="the hashing step")
        line = next(row for row in screen_text(app).splitlines() if "Hashing" in row)
        assert "Hashing model.gguf  █████░░░░░░░  42%  0." in line and line.rstrip().endswith(" s)")
        gate.set()
        await ready(pilot)


async def test_a_failed_reply_says_what_happened_and_what_to_do(tmp_path):
    app = make_app(tmp_path, factory=FakeEngineFactory(fail_at_step=3, error=SpecchatError("the drafter broke")))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await reply_done(pilot)
        totals = app.chat.query_one(AssistantMessage).totals
        assert "error: the drafter broke" in totals and "↑ edits your message, Ctrl+R retries" in totals
        toast = notifications(app)[-1]
        assert "fix the cause" not in toast and "↑ in the empty input to edit your message" in toast
        stored = app.store.messages(app.chat.conv.chat_id)[-1].stats
        assert stored["error"] == "the drafter broke"  # a reopened chat says it too


async def test_up_in_the_empty_input_edits_and_resends_the_last_message(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "first question")
        await reply_done(pilot)
        await send(pilot, "revrse a strng")
        await reply_done(pilot)
        prompt = app.chat.query_one("#prompt")
        prompt.focus()
        await pilot.press("up")
        assert prompt.text == "revrse a strng"
        assert "editing your last message" in str(app.chat.query_one("#attachments").render())
        prompt.text = "reverse a string"
        await pilot.press("enter")
        await reply_done(pilot)
        assert [(t.role, t.content[:16]) for t in app.chat.conv.turns][::2] == [
            ("user", "first question"),
            ("user", "reverse a string"),
        ]
        assert len(app.chat.conv.turns) == 4 and len(app.chat.query(UserMessage)) == 2
        stored = app.store.messages(app.chat.conv.chat_id)
        assert [m.content for m in stored if m.role == "user"] == ["first question", "reverse a string"]
        assert [m["content"] for m in app.engine.requests[-1].messages if m["role"] == "user"] == [
            "first question",
            "reverse a string",
        ]


async def test_up_then_emptying_the_input_sends_a_new_message_instead(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "one")
        await reply_done(pilot)
        prompt = app.chat.query_one("#prompt")
        prompt.focus()
        await pilot.press("up")
        prompt.text = ""
        await pilot.pause()
        await send(pilot, "two")
        await reply_done(pilot)
        assert [t.content for t in app.chat.conv.turns if t.role == "user"] == ["one", "two"]


async def test_branch_from_an_earlier_message(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        for text in ("first", "second"):
            await send(pilot, text)
            await reply_done(pilot)
        original = app.chat.conv.chat_id
        app.chat.query(AssistantMessage).first().focus()
        await pilot.press("f")
        await wait_for(pilot, lambda: app.chat.conv.chat_id != original, what="the branch")
        assert [t.content for t in app.chat.conv.turns][:1] == ["first"] and len(app.chat.conv.turns) == 2
        assert len(app.store.messages(original)) == 4  # the old chat is unchanged
        assert app.store.chat(app.chat.conv.chat_id).title.endswith("(branch)")
        await send(pilot, "another way")
        await reply_done(pilot)
        assert [m.content for m in app.store.messages(app.chat.conv.chat_id) if m.role == "user"] == [
            "first",
            "another way",
        ]
        app.chat.query(UserMessage).last().focus()  # a user message: the branch holds what came before it
        await pilot.press("f")
        await wait_for(pilot, lambda: len(app.chat.conv.turns) == 2)
        assert app.chat.query_one("#prompt").text == "another way"


async def test_the_history_list_shows_each_chats_own_pair_and_a_whole_date_at_80_columns(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "alpha")
        await reply_done(pilot)
        first = app.chat.conv.chat_id
        await app.switch_pair("plain")
        await wait_for(pilot, lambda: app.current_pair_name == "plain" and app.engine is not None)
        await app.chat.new_chat()
        await send(pilot, "beta")
        await reply_done(pilot)
        assert app.store.chat(first).pair == "smollm2-135m"  # loading another pair did not rewrite it
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        await pilot.pause()
        rows = screen_text(app).splitlines()
        day = time.strftime("%Y-%m-%d")
        default_row = next(r for r in rows if "alpha" in r)
        plain_row = next(r for r in rows if "beta" in r)
        assert any("close)" in r for r in rows)  # the dialog title wraps instead of being cut
        assert "smollm2-135m" in default_row and day in default_row and " plain " in plain_row
        assert any(day in r and ":" in r.split(day)[1][:4] for r in rows)  # the time after the date, not cut


async def test_the_picker_shows_memory_and_fits_at_80_columns_and_every_column_at_120(tmp_path):
    pairs = {**fake_pairs(), "smollm2-135m-nf4-draft": FakePair("smollm2-135m-nf4-draft", drafter="draft-model")}
    for size in ((80, 24), (120, 40)):
        app = make_app(tmp_path / f"{size[0]}", pairs=pairs)
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            await pilot.press("f2")
            await wait_for(pilot, lambda app=app: len(getattr(app.screen, "info", {})) == 4, what="estimates")
            await pilot.pause()
            text = screen_text(app)
            header = next(row for row in text.splitlines() if "drafter" in row and "memory" in row)
            assert all(word in header for word in ("pair", "memory", "fits", "download")), header
            assert "smollm2-135m-nf4-draft" in text and "16.8 GiB" in text and "NO" in text
            if size[0] == 120:
                assert "target" in header and "gated" in header and "Org/Big-7B" in text


async def test_the_footer_shows_f1_to_f4_at_80_columns(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: "Regenerate" in screen_text(app), what="the footer")
        footer = screen_text(app).splitlines()[-1]
        assert all(f"f{n} " in footer for n in (1, 2, 3, 4)), footer


async def test_settings_name_the_pair_default_value(tmp_path):
    pairs = fake_pairs()
    pairs["smollm2-135m"] = FakePair("smollm2-135m", sampling={"temperature": 0.2}, gamma="auto")
    app = make_app(tmp_path, pairs=pairs)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        await pilot.pause()
        text = screen_text(app)
        assert "smollm2-135m default: 0.2" in text and "the model's default" in text
        assert "Pair default (auto)" in text


async def test_the_help_is_a_centred_dialog_over_the_dimmed_chat(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.pause()
        dialog = app.screen.query_one("#help").region
        assert dialog.x > 0 and dialog.right < 80 and abs(dialog.x - (80 - dialog.right)) <= 1
        assert app.screen.has_class("dialog-screen")
