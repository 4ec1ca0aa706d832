"""A reopened chat is read into the engine's cache before the user sends (issue 36: its next reply re-read the
whole conversation, 31.9 s for 2,692 tokens): screens/warmer.py, on the fake engine."""

from __future__ import annotations

from app_harness import make_app, ready, reply_done, send, wait_for

from specchat.app.tui.screens.history import HistoryScreen


def stats_text(app) -> str:
    return str(app.chat.query_one("#stats-text").render())


async def reopen_first_chat(pilot, passes: int, tokens: int, delay_s: float) -> str:
    """Write one exchange, start a new chat, and open the first one again from the history (F4); the engine reads
    a prompt from then on in ``passes`` passes of ``delay_s`` each, reporting ``tokens`` in all."""
    app = pilot.app
    await ready(pilot)
    await send(pilot, "first question")
    await reply_done(pilot)
    engine = app.engine
    engine.prefill_passes, engine.prefill_tokens, engine.prefill_delay_s = passes, tokens, delay_s
    first = app.chat.conv.chat_id
    await pilot.press("ctrl+n")
    await pilot.press("f4")
    assert isinstance(app.screen, HistoryScreen)
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.chat.conv.chat_id == first)
    return first


async def test_a_reopened_chat_is_read_into_the_cache_with_progress_then_says_it_is_ready(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await reopen_first_chat(pilot, 8, 2692, 0.15)
        await wait_for(pilot, lambda: len(app.engine.requests) == 2, what="the warmer's request")
        warm = app.engine.requests[1]
        assert warm.conversation == app.chat.conv.key and warm.prefill_progress
        assert warm.sampling.max_new_tokens == 1 and [m["role"] for m in warm.messages] == ["user", "assistant"]
        await wait_for(pilot, lambda: "preparing this chat: reading" in stats_text(app), what="warm progress")
        assert "/ 2,692 tokens" in stats_text(app) and "Enter sends anyway" in stats_text(app)
        await wait_for(pilot, lambda: "this chat is ready" in stats_text(app), what="the warmer's outcome")
        assert not app.chat.warmer.running and not app.engine.active.is_set()
        assert not app.chat.generating and len(app.chat.conv.turns) == 2  # the sampled token reached nothing


async def test_sending_while_the_chat_is_read_stops_the_reading_and_the_reply_goes_on(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await reopen_first_chat(pilot, 50, 5000, 0.1)
        await wait_for(pilot, lambda: "preparing this chat" in stats_text(app), what="warm progress")
        app.engine.prefill_passes = 0  # the reply itself reads nothing more
        await send(pilot, "follow-up")  # the fake engine fails the test if two generate() calls overlap
        await reply_done(pilot)
        assert not app.chat.warmer.running
        assert [m["content"] for m in app.engine.requests[-1].messages][-1] == "follow-up"
        await pilot.pause(0.3)
        assert "preparing this chat" not in stats_text(app) and "last reply" in stats_text(app)  # no late note


async def test_an_empty_chat_is_not_read(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        app.chat.warmer.start()  # a new chat: nothing to read
        assert not app.chat.warmer.running and not app.engine.requests
