"""Pilot tests of the chat screen on the fake engine: sending, streaming, stop, regenerate, statistics,
the accepted-token view, the details panel, copying."""

from __future__ import annotations

import time

from app_harness import make_app, notifications, ready, reply_done, send, wait_for
from fake_engine import CANNED_REPLY, FakeEngineFactory
from textual.widgets import Static

from specchat.app.tui.messages import ReplyProgress
from specchat.app.tui.screens import reply_controller as chat_module
from specchat.app.tui.widgets.details_panel import DetailsPanel
from specchat.app.tui.widgets.message_view import AssistantMessage, UserMessage
from specchat.app.tui.widgets.stats_bar import StatsBar
from specchat.backend.api import TokenSource


def stats_text(app) -> str:
    return str(app.chat.query_one("#stats-text").render())


async def test_send_streams_the_reply_and_saves_it(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "reverse a string in python")
        await reply_done(pilot)
        chat = app.chat
        assert chat.query_one("#prompt").text == ""
        views = list(chat.query(AssistantMessage))
        assert len(views) == 1 and views[0].text == CANNED_REPLY
        assert [type(v) for v in chat.query(".message")] == [UserMessage, AssistantMessage]
        # the code block was rendered as a fence (syntax highlighted), not as plain text
        assert views[0].code_blocks() == ["def reverse(text: str) -> str:\n    return text[::-1]"]
        request = app.engine.requests[0]
        assert request.messages == [{"role": "user", "content": "reverse a string in python"}]
        assert request.conversation == f"chat-{chat.conv.chat_id}"
        stored = app.store.messages(chat.conv.chat_id)
        assert [(m.role, m.content) for m in stored] == [
            ("user", "reverse a string in python"),
            ("assistant", CANNED_REPLY),
        ]
        assert stored[1].complete and stored[1].stats["finish_reason"] == "eos"
        assert stored[1].stats["new_tokens"] == 79


async def test_stream_is_incremental_and_coalesced(tmp_path):
    """A slow engine: text appears while the reply streams, and nudges stay at ~10 a second."""
    nudges: dict[int, ReplyProgress] = {}  # by id: the hook sees a message both when posted and handled
    factory = FakeEngineFactory(step_delay_s=0.04)
    app = make_app(tmp_path, factory=factory)

    def hook(message) -> None:
        if isinstance(message, ReplyProgress):
            nudges.setdefault(id(message), message)

    async with app.run_test(size=(120, 40), message_hook=hook) as pilot:
        await ready(pilot)
        started = time.monotonic()
        await send(pilot, "hi")
        await wait_for(pilot, lambda: any(v.text for v in app.chat.query(AssistantMessage)), what="first text")
        view = app.chat.query_one(AssistantMessage)
        partial = view.text
        assert partial and len(partial) < len(CANNED_REPLY) and app.chat.generating
        assert "tok/s" in stats_text(app) and "●" in stats_text(app)
        assert "esc stop" in stats_text(app)  # the hint is in the stats line: the footer stays as it was
        await reply_done(pilot)
        elapsed = time.monotonic() - started
        assert view.text == CANNED_REPLY and "esc stop" not in stats_text(app)
        # 27 events over >= 1 s of decoding: at most ~10 nudges a second (+ the first and the last), so fewer
        # nudges than events; how many depends on how long the (loaded) machine took
        assert 3 <= len(nudges) <= min(26, 10 * elapsed + 2)


async def test_text_redraws_are_paced_apart_from_the_statistics(tmp_path, monkeypatch):
    """Redrawing the reply's text is a layout pass of the screen, so it happens at most every text interval;
    the one-line stats bar redraws at every nudge; the finished reply shows all of its text."""
    monkeypatch.setattr(chat_module, "TEXT_INTERVAL_S", (0.5, 0.5))
    monkeypatch.setattr(chat_module, "UI_CPU_BUDGET", 1.0)  # keep the intervals where they start
    draws: list[float] = []
    stats: list[float] = []
    show_pending, show_live = AssistantMessage.show_pending, StatsBar.show_live

    async def counted_show_pending(self) -> None:
        if self._unshown and self.streaming:
            draws.append(time.monotonic())
        await show_pending(self)

    def counted_show_live(self, live, *, streaming: bool) -> None:
        if streaming:
            stats.append(time.monotonic())
        show_live(self, live, streaming=streaming)

    monkeypatch.setattr(AssistantMessage, "show_pending", counted_show_pending)
    monkeypatch.setattr(StatsBar, "show_live", counted_show_live)
    app = make_app(tmp_path, factory=FakeEngineFactory(step_delay_s=0.06))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await wait_for(pilot, lambda: len(draws) >= 2, what="a second text redraw")
        view = app.chat.query_one(AssistantMessage)
        assert app.chat.generating and len(view.text) < len(CANNED_REPLY)
        await reply_done(pilot)
        assert view.text == CANNED_REPLY and view.code_blocks()  # all of it drawn, as Markdown
    paced = [later - earlier for earlier, later in zip(draws, draws[1:-1])]  # the last draw is the finish's
    assert paced and min(paced) >= 0.45
    assert len(stats) >= 2 * (len(draws) - 1)


async def test_stop_keeps_the_partial_reply(tmp_path):
    app = make_app(tmp_path, factory=FakeEngineFactory(step_delay_s=0.05))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await wait_for(pilot, lambda: len(app.chat.query_one(AssistantMessage).text) > 10, what="some text")
        await pilot.press("escape")
        await reply_done(pilot)
        view = app.chat.query_one(AssistantMessage)
        assert 10 < len(view.text) < len(CANNED_REPLY)
        assert "stopped" in view.totals
        assert not app.engine.active.is_set()  # the worker ended before the UI went on
        stored = app.store.messages(app.chat.conv.chat_id)[-1]
        assert stored.content == view.text and not stored.complete
        assert stored.stats["finish_reason"] == "cancelled"
        await pilot.press("escape")  # nothing to stop: harmless


async def test_regenerate_and_send_during_a_reply(tmp_path):
    """Regenerate replaces the last reply; a send during a reply stops it first (the engine has one owner:
    the fake raises if a second generate() starts before the first ended)."""
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await reply_done(pilot)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(app.engine.requests) == 2)
        await reply_done(pilot)
        assert len(app.chat.query(AssistantMessage)) == 1
        assert app.engine.requests[1].messages == [{"role": "user", "content": "hi"}]
        assert [m.role for m in app.store.messages(app.chat.conv.chat_id)] == ["user", "assistant"]
        app.engine.step_delay_s = 0.05
        await send(pilot, "second")
        await wait_for(pilot, lambda: app.engine.active.is_set() and app.chat.generating)
        await send(pilot, "third")
        await wait_for(pilot, lambda: len(app.engine.requests) == 4)
        await pilot.press("escape")
        await reply_done(pilot)
        assert [t.role for t in app.chat.conv.turns] == ["user", "assistant"] * 3
        assert not any("Reply failed" in n for n in notifications(app))
        assert app.engine.requests[3].messages[-1] == {"role": "user", "content": "third"}
        assert app.engine.requests[3].messages[-2]["role"] == "assistant"  # the stopped partial reply


async def test_stats_bar_totals_and_details_panel(tmp_path):
    app = make_app(tmp_path, factory=FakeEngineFactory(pause_every=5))
    async with app.run_test(size=(140, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await reply_done(pilot)
        stats = app.store.messages(app.chat.conv.chat_id)[-1].stats  # the engine's final stats, as saved
        acc, tau = f"{stats['acceptance_rate'] * 100:.0f}%", f"{stats['mean_accepted_length']:.2f}"
        assert stats["spec_paused_steps"] == 5
        bar = stats_text(app)
        assert f"acc {acc}" in bar and f"τ {tau}" in bar and "last reply: prompt-lookup" in bar
        assert "speculating" not in bar and "γ" not in bar  # idle: what the last reply did, not a step state
        assert f"{stats['tok_s']:.1f} tok/s" in bar  # the finished reply shows the engine's own tok/s
        line = app.chat.query_one("#stats-text")
        drawn = line.render_line(0)  # drawn from Rich segments: one line, exactly as wide, the same text
        assert drawn.cell_length == line.size.width and "\n" not in drawn.text
        assert drawn.text.rstrip() == bar.rstrip()
        totals = app.chat.query_one(AssistantMessage).totals
        assert totals.startswith("79 tokens") and f"acceptance {acc}" in totals and f"τ {tau}" in totals
        panel = app.chat.query_one(DetailsPanel)
        assert not panel.display
        await pilot.press("ctrl+g")
        assert panel.display
        text = str(panel.render())
        assert "Per-position acceptance" in text and "expected 1.80×" in text
        # pause_every=5 gives 5 plain steps: under MIN_STEPS, so no step-speed ratio is claimed, and why
        assert "spec ÷ plain steps —" in text and "needs 8 of each; this reply: 22 speculating, 5 plain" in text
        await pilot.press("ctrl+g")
        assert not panel.display


async def test_accepted_token_view_and_copying(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+o")
        assert "no reply" in notifications(app)[-1]
        await send(pilot, "hi")
        await reply_done(pilot)
        view = app.chat.query_one(AssistantMessage)
        sources = {source for _, source in view.tokens}
        assert sources == {TokenSource.TARGET, TokenSource.ACCEPTED, TokenSource.RECOVERED, TokenSource.BONUS}
        assert "".join(text for text, _ in view.tokens) == CANNED_REPLY
        await pilot.press("ctrl+t")
        assert not view.query_one("#body").display and view.query_one("#token-view").display
        legend = str(view.query_one("#legend", Static).render())
        assert "accepted draft" in legend and "recovered" in legend and "bonus" in legend
        rendered = view.query_one("#tokens", Static).render()
        assert str(rendered) == CANNED_REPLY
        styles = " ".join(str(span.style) for span in rendered.spans)
        assert "green" in styles and "yellow" in styles and "magenta" in styles
        await pilot.press("ctrl+t")
        assert view.query_one("#body").display
        await pilot.press("ctrl+o")
        assert app.clipboard == CANNED_REPLY
        await pilot.press("ctrl+b")
        assert app.clipboard == "def reverse(text: str) -> str:\n    return text[::-1]"
        app.copy_to_clipboard("")
        await pilot.click(app.chat.query_one("CopyableFence"))
        assert app.clipboard.startswith("def reverse")


async def test_prompt_keys_newline_and_unknown_command(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        prompt = app.chat.query_one("#prompt")
        prompt.focus()
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb" and not app.engine.requests
        prompt.text = "/frobnicate"
        await pilot.press("enter")
        assert prompt.text == "/frobnicate"  # kept so it can be fixed
        assert "Unknown command /frobnicate" in notifications(app)[-1]
        prompt.text = "//frobnicate"
        await pilot.press("enter")
        await reply_done(pilot)
        assert app.engine.requests[0].messages[-1]["content"] == "/frobnicate"


async def test_plain_pair_shows_plain_decoding(tmp_path):
    app = make_app(tmp_path, initial_pair="plain")
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await reply_done(pilot)
        assert "plain decoding" in stats_text(app)
        assert "acceptance" not in app.chat.query_one(AssistantMessage).totals


async def test_view_follows_the_reply_unless_scrolled_up(tmp_path, monkeypatch):
    # one long code block: a single widget that grows (cheaper to render than many paragraphs). Actions are
    # called directly while text streams: pilot.press waits for an idle app, which a stream never is.
    # Text is redrawn every 0.25 s here (on a busy test machine the UI would pace it down to once a second).
    monkeypatch.setattr(chat_module, "UI_CPU_BUDGET", 1.0)
    long_reply = "```\n" + "".join(f"line {i}\n" for i in range(80)) + "```\n"
    app = make_app(tmp_path, factory=FakeEngineFactory(reply=long_reply, step_delay_s=0.03))
    async with app.run_test(size=(100, 24)) as pilot:
        await ready(pilot)
        scroll = app.chat.query_one("#conversation")
        await send(pilot, "tell me a lot")
        await wait_for(pilot, lambda: scroll.max_scroll_y > 5, what="the reply to overflow the view")
        assert scroll.scroll_y >= scroll.max_scroll_y - 1  # following the new text
        scroll.action_scroll_home()  # the user scrolls up to reread (the Home key's action)
        await pilot.pause(0.3)
        height = scroll.max_scroll_y
        await wait_for(pilot, lambda: scroll.max_scroll_y > height + 3, what="more text")
        assert app.chat.generating and scroll.scroll_y < 1  # more text came, the view stayed put
        scroll.action_scroll_end()  # back at the bottom: following again
        await wait_for(pilot, lambda: scroll.max_scroll_y > height + 8, what="more text")
        assert scroll.scroll_y >= scroll.max_scroll_y - 1
        await app.chat.stop_generation()
