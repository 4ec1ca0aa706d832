"""Pilot tests of the error paths: each is a clear notification, the app keeps running, no history is lost."""

from __future__ import annotations

import logging

from app_harness import make_app, notifications, ready, reply_done, send, wait_for
from fake_engine import FakeEngineFactory

from specchat.app.cli.wiring import route_library_output
from specchat.app.tui.screens.dialogs import ConfirmScreen
from specchat.app.tui.widgets.message_view import AssistantMessage
from specchat.backend.errors import InsufficientMemoryError, KVCacheFullError, ModelLoadError, RequestError


async def test_load_failures_keep_the_app_usable(tmp_path):
    factory = FakeEngineFactory(fail={"smollm2-135m": ModelLoadError("packaged GGUF missing: reinstall specchat")})
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: any("Could not load smollm2-135m" in n for n in notifications(app)))
        assert "reinstall specchat" in notifications(app)[-1] and app.engine is None
        await send(pilot, "hello?")
        assert "No model is loaded" in notifications(app)[-1]
        assert app.store.messages(app.chat.conv.chat_id)[0].content == "hello?"  # kept
        factory.fail.clear()
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(app.screen.info) == 3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("ctrl+r")  # answers the waiting message
        await wait_for(pilot, lambda: bool(app.engine.requests))
        await reply_done(pilot)
        assert [m.role for m in app.store.messages(app.chat.conv.chat_id)] == ["user", "assistant"]
        # a pair that does not fit: a clear notice, and the previous pair is loaded again
        factory.fail["plain"] = InsufficientMemoryError("plain needs 20 GB, 8 GB free")
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(app.screen.info) == 3)
        await pilot.press("down", "down", "enter")
        await wait_for(pilot, lambda: factory.calls[-2:] == ["plain", "smollm2-135m"] and app.engine is not None)
        assert any("plain does not fit" in n and "20 GB" in n and "smaller pair" in n for n in notifications(app))
        assert app.current_pair_name == "smollm2-135m" and len(app.chat.query(AssistantMessage)) == 1


async def test_message_sent_while_loading_is_answered_when_ready(tmp_path):
    factory = FakeEngineFactory()
    factory.release.clear()
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.loading_pair == "smollm2-135m")
        await send(pilot, "early bird")
        assert "still loading" in notifications(app)[-1]
        assert "loading" in str(app.chat.query_one("#stats-text").render())
        factory.release.set()
        await ready(pilot)
        await wait_for(pilot, lambda: bool(app.engine.requests))
        await reply_done(pilot)
        assert app.chat.query_one(AssistantMessage).text


async def test_context_full_and_engine_notices_are_reported_and_history_kept(tmp_path):
    app = make_app(tmp_path, factory=FakeEngineFactory(end_with_context=True, notice_at_step=2))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "a long chat")
        await reply_done(pilot)
        assert any("drafter switched off" in n for n in notifications(app))  # a notice mid-reply
        assert any(n.startswith("Context full") and "longer than the context" in n for n in notifications(app))
        stored = app.store.messages(app.chat.conv.chat_id)
        assert stored[-1].stats["finish_reason"] == "context" and stored[-1].content
        assert "context full" in app.chat.query_one(AssistantMessage).totals
        # the engine may also raise when its KV pool is exhausted
        app.engine.end_with_context, app.engine.fail_at_step = False, 4
        app.engine.error = KVCacheFullError("no free KV block")
        await send(pilot, "more")
        await reply_done(pilot)
        assert notifications(app)[-1].startswith("Context full") and "Ctrl+N" in notifications(app)[-1]
        assert [m.role for m in app.store.messages(app.chat.conv.chat_id)] == ["user", "assistant"] * 2


async def test_error_mid_reply_keeps_the_partial_reply_and_the_app_runs_on(tmp_path):
    app = make_app(tmp_path, factory=FakeEngineFactory(fail_at_step=5, error=RequestError("top_p must be in (0, 1]")))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await reply_done(pilot)
        assert any(n.startswith("Reply failed") and "top_p" in n and "Ctrl+R" in n for n in notifications(app))
        view = app.chat.query_one(AssistantMessage)
        assert view.text and "error" in view.totals
        stored = app.store.messages(app.chat.conv.chat_id)[-1]
        assert stored.content == view.text and not stored.complete and stored.stats["finish_reason"] == "error"
        app.engine.fail_at_step = None
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(app.engine.requests) == 2)
        await reply_done(pilot)
        assert app.store.messages(app.chat.conv.chat_id)[-1].complete


async def test_internal_error_is_logged_with_its_traceback(tmp_path):
    log_path = tmp_path / "specchat.log"
    with route_library_output(log_path):
        app = make_app(tmp_path, factory=FakeEngineFactory(fail_at_step=2, error=ZeroDivisionError("boom")))
        async with app.run_test(size=(120, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "hi")
            await reply_done(pilot)
            assert any(
                "Internal error: ZeroDivisionError: boom" in n and str(log_path) in n for n in notifications(app)
            )
    text = log_path.read_text()
    assert "Traceback" in text and "ZeroDivisionError: boom" in text
    assert "stray library output from the loader thread" in text  # the loader's print went to the log
    assert not logging.getLogger().handlers or all(
        h.__class__.__name__ != "FileHandler" for h in logging.getLogger().handlers
    )


async def test_brackets_in_user_text_are_never_parsed_as_markup(tmp_path, monkeypatch):
    """Paths, titles and error text with [brackets] (e.g. "[Errno 2]") are shown literally, never crash."""
    monkeypatch.chdir(tmp_path)
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit [red]x[/bold].py")
        assert "[red]x[/bold].py" in notifications(app)[-1]
        await send(pilot, "[bold]title[/i] with [brackets")
        await reply_done(pilot)
        await pilot.press("f4")
        await pilot.pause()
        assert "[bold]title[/i]" in str(app.screen.query_one("DataTable").get_row_at(0)[0])


async def test_a_download_at_start_up_is_asked_first_and_one_from_the_picker_once(tmp_path):
    factory = FakeEngineFactory(downloads={"big-pair": 16_000_000_000})
    app = make_app(tmp_path, factory=factory, initial_pair="big-pair")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the download question")
        assert "14.9 GiB" in str(app.screen.query_one(".dialog-body").render())
        await pilot.press("n")  # declined: nothing loads, the app goes on
        await wait_for(pilot, lambda: any("declined" in n for n in notifications(app)))
        assert app.engine is None and factory.confirmations == [("big-pair", False)]
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(app.screen.info) == 3)
        await pilot.press("down", "enter")  # big-pair: the picker asks (download, then fit) ...
        for _ in range(2):
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("y")
        await wait_for(pilot, lambda: app.engine is not None)  # ... and the loader does not ask again
        assert factory.confirmations[-1] == ("big-pair", True) and app.current_pair_name == "big-pair"
