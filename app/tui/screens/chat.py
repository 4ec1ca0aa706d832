"""The chat screen: the conversation, the prompt, the live statistics; it owns the generation worker.

Contract:
- One generation at a time: a thread worker (group "generate") runs :func:`run_generation`; the worker only
  fills a :class:`ReplyBuffer` and posts :class:`ReplyProgress` nudges (≤ ~10 a second). Every widget
  update happens here, on the UI thread, when a nudge is drained.
- The UI must not slow decoding: the engine competes for the same cores (a parallel torch op waits for its
  slowest thread, so a busy UI thread costs decoding more than its own share) and for the GIL. So each nudge
  redraws only the stats bar (one line, no layout pass); the reply's text is drawn at most every
  ``text_interval`` (0.25 s, up to 1 s), mostly as a repaint of the message's StreamTail: a layout pass of
  the screen (~20-40 ms) comes only when the tail takes its next step of height. Every second
  the UI thread's CPU share is checked: above ``UI_CPU_BUDGET`` of a core the text interval grows, then the
  nudge interval (0.1 s, up to 0.25 s); below half of it they shrink back, in the reverse order. New text is
  handed to the StreamingSaver at every nudge, however rarely it is drawn.
- No torch op runs on the UI thread. A thread that runs one gets its own OpenMP team; with two teams alive
  libgomp has more threads than cores and stops spinning between parallel regions, and decoding in the
  worker slowed ~9% (measured on 2 cores: ~57,000 voluntary context switches per 128-token reply instead of
  a few). The loader thread's team goes away when it ends, before any reply starts.
- Stop (Esc), regenerate, send, new/open chat and pair switches call :meth:`stop_generation` first: it sets
  the cancel event, waits for the worker thread to end, drains what is left and finishes the reply (the
  partial text is kept, shown and saved) before anything else starts.
- A reply is saved while it streams (StreamingSaver, ≤ 0.5 s behind) and at its end with its stats.
- A reply asks the engine for prefill progress: until its first token, the stats bar and the reply's totals
  line say "reading prompt 2,300 / 4,936 tokens" (redrawn each second for the time so far); Esc stops it
  between two passes over the prompt.
- Errors become notifications that say what to do (Ctrl+R retries, Up edits the message and sends it again);
  the reply's totals line keeps what went wrong. The screen and the history stay usable.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static
from textual.worker import Worker, WorkerCancelled, WorkerError, WorkerFailed

from specchat.app.chat.conversation import Conversation, Turn
from specchat.app.chat.editing import edit_prediction
from specchat.app.tui.bridge import LiveView, ReplyBuffer, ReplyOutcome, run_generation
from specchat.app.tui.messages import PromptSubmitted, ReplyProgress
from specchat.app.tui.screens.chat_actions import WELCOME, ChatActionsMixin
from specchat.app.tui.widgets.details_panel import DetailsPanel
from specchat.app.tui.widgets.message_view import AssistantMessage, MessageView, UserMessage
from specchat.app.tui.widgets.prompt_input import PromptInput
from specchat.app.tui.widgets.stats_bar import StatsBar, prefill_line, reply_totals
from specchat.backend.api import GenerationRequest

if TYPE_CHECKING:
    from specchat.app.chat.edit_files import AppliedEdit
    from specchat.app.chat.editing import EditTarget
    from specchat.app.chat.history.saver import StreamingSaver
    from specchat.backend.api import EngineAPI

COMPLETE_REASONS = frozenset({"eos", "stop", "length", "context"})
UI_CPU_BUDGET = 0.03  # share of one core the UI thread may use while a reply streams
STATS_INTERVAL_S = (0.1, 0.25)  # the worker's nudges; each redraws the stats bar (one line, no layout pass)
TEXT_INTERVAL_S = (0.25, 1.0)  # how often the growing reply is redrawn (mostly a repaint of its tail)


def adapt_intervals(share: float, stats_interval: float, text_interval: float) -> tuple[float, float]:
    """The next (stats, text) redraw intervals given the UI thread's CPU ``share`` of a core: over
    ``UI_CPU_BUDGET``, the text's grows 1.5x and, once that is at its bound, the statistics'; under half the
    budget they shrink 1.5x in the reverse order (statistics first); both stay within their bounds."""
    (stats_low, stats_high), (text_low, text_high) = STATS_INTERVAL_S, TEXT_INTERVAL_S
    if share > UI_CPU_BUDGET:
        if text_interval < text_high:
            return stats_interval, min(text_high, text_interval * 1.5)
        return min(stats_high, stats_interval * 1.5), text_interval
    if share < UI_CPU_BUDGET / 2:
        if stats_interval > stats_low:
            return max(stats_low, stats_interval / 1.5), text_interval
        return stats_interval, max(text_low, text_interval / 1.5)
    return stats_interval, text_interval


@dataclass(eq=False)
class ActiveReply:
    reply_id: int
    turn: Turn
    view: AssistantMessage
    saver: StreamingSaver | None
    edit: tuple[list[EditTarget], str] | None  # the /edit files and request this reply answers
    buffer: ReplyBuffer = field(default_factory=ReplyBuffer)
    cancel: threading.Event = field(default_factory=threading.Event)
    worker: Worker | None = None
    live: LiveView = field(default_factory=LiveView)
    finished: bool = False
    shown_at: float = float("-inf")  # time.monotonic() of the last redraw of its text


class ChatScreen(ChatActionsMixin, Screen):
    BINDINGS = [
        # Not in the footer: showing it only while a reply streams would recompose the footer (a layout pass
        # of the screen, ~0.1 s) as each reply starts; the stats bar says "esc stop" while one streams.
        Binding("escape", "stop", "Stop", show=False),
        # The app's F-keys again, first: the footer lists the screen's keys before the app's, and at 80 columns
        # the last ones do not fit.
        Binding("f1", "app.help", "Help"),
        Binding("f2", "app.pick_pair", "Pair"),
        Binding("f3", "app.settings", "Settings"),
        Binding("f4", "app.history", "History"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+t", "toggle_tokens", "Token view"),
        Binding("ctrl+g", "toggle_details", "Details"),
        Binding("ctrl+o", "copy_reply", "Copy reply", show=False),
        Binding("ctrl+b", "copy_code", "Copy code", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(id="chat")
        self.conv = Conversation(None, self._history_error)
        self.token_view = False
        self.pending_files: list[tuple[str, str, str]] = []  # (name shown, context text, path)
        self.pending_edits: list[EditTarget] = []
        self.applied_edits: list[AppliedEdit] = []  # this session's applied /edit, for /undo
        self.resend_from: int | None = None  # the turn an edited last message replaces (Up in the empty input)
        self._active: ActiveReply | None = None
        self._replies: dict[int, ActiveReply] = {}
        self._ids = itertools.count(1)
        self._drain_lock = asyncio.Lock()
        self._waiting_reply = False  # a reply to start once the model has loaded
        self._waiting_edit: tuple[list[EditTarget], str] | None = None  # the /edit files of that reply
        self._last = LiveView()  # the last finished reply's, for the details panel
        self.stats_interval, self.text_interval = STATS_INTERVAL_S[0], TEXT_INTERVAL_S[0]
        self._cpu_mark = (time.thread_time(), time.monotonic())
        self._history_warned = False
        self._widgets: dict[type, Any] = {}

    # -- layout ----------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="main"):
            with VerticalScroll(id="conversation"):
                yield Static(WELCOME, id="welcome")
            yield DetailsPanel(id="details")
        yield Static("", id="attachments", markup=False)
        yield PromptInput(id="prompt")
        yield StatsBar(id="stats")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(1.0, self._tick)
        self.conv.store = self.app.store
        self.query_one("#details").display = False
        self.query_one("#attachments").display = False
        self.query_one("#conversation", VerticalScroll).anchor()
        self.query_one(PromptInput).focus()

    @property
    def stats_bar(self) -> StatsBar:
        return self._widget(StatsBar)

    def _widget(self, kind: type[Any]) -> Any:
        """The screen's one ``kind`` widget, looked up once: a DOM query per nudge cost ~0.5 ms of UI thread."""
        found = self._widgets.get(kind)
        if found is None or not found.is_attached:
            found = self._widgets[kind] = self.query_one(kind)
        return found

    @property
    def generating(self) -> bool:
        return self._active is not None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating
        return True

    def _history_error(self, message: str) -> None:
        if not self._history_warned:  # one notification, not one per token batch
            self._history_warned = True
            self.notify(
                message + " The chat goes on, but may not be saved.", title="History", severity="error", timeout=10
            )

    def update_title(self) -> None:
        self.app.sub_title = f"{self.app.current_pair_name or 'no model'} · {self.conv.title}"

    async def _mount_messages(self, *views: MessageView) -> None:
        scroll = self.query_one("#conversation", VerticalScroll)
        for welcome in scroll.query("#welcome"):
            await welcome.remove()
        await scroll.mount_all(views)

    # -- sending -----------------------------------------------------------------------------------------------
    async def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        text = message.text
        if not text.strip():
            return
        if text.startswith("/") and not text.startswith("//"):
            if await self.run_command(text):
                self.query_one(PromptInput).clear()
            return
        self.query_one(PromptInput).clear()
        if self.resend_from is not None:
            index, self.resend_from = self.resend_from, None
            await self.replace_from(index)
        await self.send(text[1:] if text.startswith("//") else text)

    async def send(self, request: str) -> None:
        """Send ``request`` (with any pending attachments) and start the reply."""
        from specchat.app.chat.editing import EditError, build_edit_prompt

        files, edits = self.pending_files, self.pending_edits
        parts = [context for _, context, _ in files]
        meta: dict[str, Any] = {}
        if edits:
            try:
                parts.append(build_edit_prompt(edits, request))
            except EditError as error:
                self.notify(str(error), title="/edit", severity="error", timeout=8)
                return
            meta["edit"] = [str(t.path) for t in edits]
        else:
            parts.append(request)
        if files or edits:
            meta["request"] = request
            meta["attachments"] = [name for name, _, _ in files] + [t.shown for t in edits]
            if files:
                meta["files"] = [path for _, _, path in files]
        self.pending_files, self.pending_edits, self.resend_from = [], [], None
        self.update_attachments()
        await self.stop_generation()
        turn = self.conv.add_user("\n\n".join(parts), self.app.current_pair_name or "", meta)
        self.update_title()
        await self._mount_messages(UserMessage(turn.display, turn.content))
        self.query_one("#conversation", VerticalScroll).anchor()  # a new message follows the reply again
        await self.start_reply((edits, request) if edits else None)

    async def start_reply(self, edit: tuple[list[EditTarget], str] | None = None) -> None:
        engine = self.app.engine
        if engine is None:
            if self.app.loading_pair:
                self._waiting_reply, self._waiting_edit = True, edit
                self.notify(f"{self.app.loading_pair} is still loading; the reply starts when it is ready.", timeout=4)
            else:
                self.notify(
                    "No model is loaded. Choose a model pair with F2, then press Ctrl+R to answer.",
                    title="No model",
                    severity="error",
                    timeout=8,
                )
            return
        settings = self.app.settings
        request = GenerationRequest(
            messages=self.conv.request_messages(settings.system_prompt),
            sampling=settings.sampling(),
            drafter=settings.request_drafter(),
            gamma=settings.gamma,
            conversation=self.conv.key,
            prefill_progress=True,
            prediction=edit_prediction(edit[0]) if edit else None,  # a whole-file /edit: drafted from the file
        )
        turn, saver = self.conv.start_reply()
        view = AssistantMessage(header=f"Assistant · {self.app.current_pair_name}", token_view=self.token_view)
        await self._mount_messages(view)
        view.start_stream()
        reply = ActiveReply(next(self._ids), turn, view, saver, edit)
        self._replies[reply.reply_id] = reply
        self._active = reply
        self._cpu_mark = (time.thread_time(), time.monotonic())
        self.query_one(PromptInput).cursor_blink = False  # a blink repaints the input twice a second
        reply.worker = self._generate(engine, request, reply)

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def _generate(self, engine: EngineAPI, request: GenerationRequest, reply: ActiveReply) -> None:
        run_generation(
            engine,
            request,
            reply.cancel,
            reply.buffer,
            lambda: self.post_message(ReplyProgress(reply.reply_id)),
            interval_s=lambda: self.stats_interval,
        )  # read at each step: the UI adapts it

    async def engine_ready(self) -> None:
        """Called by the app when a model finished loading: start a reply that was waiting for it."""
        if self._waiting_reply:
            self._waiting_reply = False
            await self.start_reply(self._waiting_edit)

    def engine_unavailable(self) -> None:
        if self._waiting_reply:
            self._waiting_reply = False
            self.notify("Your message is kept; press Ctrl+R to answer it once a model is loaded.", timeout=8)

    # -- streaming -------------------------------------------------------------------------------------------
    async def on_reply_progress(self, message: ReplyProgress) -> None:
        reply = self._replies.get(message.reply_id)
        if reply is not None:
            await self._drain(reply)

    async def _drain(self, reply: ActiveReply) -> None:
        async with self._drain_lock:
            if reply.finished:
                return
            delta = reply.buffer.drain()
            reply.live = delta.live
            if delta.text or delta.tokens:
                reply.view.append(delta.text, delta.tokens)
                if delta.text and reply.saver is not None:
                    reply.saver.append(delta.text)  # saved ≤ 0.5 s behind, however rarely it is drawn
            now = time.monotonic()
            if delta.outcome is None and now - reply.shown_at >= self.text_interval:
                reply.shown_at = now
                self._adapt_intervals(now)
                await reply.view.show_pending()
            self.stats_bar.show_live(delta.live, streaming=delta.outcome is None)
            if delta.outcome is None:
                self._show_prefill(reply)
            details = self._widget(DetailsPanel)
            if details.display:
                details.update_stats(delta.live)
            for notice in delta.notices:
                self.notify(notice, severity="warning", timeout=8)
            if delta.outcome is not None:
                await self._finish(reply, delta.outcome)

    def _show_prefill(self, reply: ActiveReply) -> None:
        """Until the first token: say in the reply how much of the prompt has been read."""
        prefill = reply.live.prefill
        if prefill is not None and not reply.live.stats.new_tokens:
            done, total, started = prefill
            reply.view.show_status(f"{prefill_line(done, total, time.monotonic() - started)} · Esc stops")
        elif reply.view.totals:
            reply.view.show_status("")

    def _tick(self) -> None:
        """Each second: while a reply reads its prompt, redraw its progress (the time so far moves on)."""
        reply = self._active
        if reply is not None and reply.live.prefill is not None and not reply.live.stats.new_tokens:
            self.stats_bar.show_live(reply.live, streaming=True)
            self._show_prefill(reply)

    def _adapt_intervals(self, now: float) -> None:
        """Every second: pace the redraws to the UI thread's CPU share since the last check."""
        cpu_then, wall_then = self._cpu_mark
        if now - wall_then < 1.0:
            return
        cpu = time.thread_time()
        share = (cpu - cpu_then) / (now - wall_then)
        self._cpu_mark = (cpu, now)
        self.stats_interval, self.text_interval = adapt_intervals(share, self.stats_interval, self.text_interval)

    async def _finish(self, reply: ActiveReply, outcome: ReplyOutcome) -> None:
        reply.finished = True
        self._replies.pop(reply.reply_id, None)
        if self._active is reply:
            self._active = None
            self.query_one(PromptInput).cursor_blink = True
        if outcome.stats is not None:  # the engine's totals (a stop before its last event keeps the latest stats)
            reply.live = LiveView(outcome.stats, reply.live.drafter, None)
        live, stats = reply.live, reply.live.stats
        error = (outcome.message or "unknown error") if outcome.finish_reason == "error" else None
        await reply.view.finish(reply_totals(stats, outcome.finish_reason, error))
        complete = outcome.finish_reason in COMPLETE_REASONS
        self.conv.finish_reply(
            reply.turn,
            reply.saver,
            reply.view.text,
            stats,
            finish_reason=outcome.finish_reason,
            pair=self.app.current_pair_name or "",
            complete=complete,
            error=error,
        )
        self._last = live
        self.stats_bar.show_live(live, streaming=False)
        self.query_one(DetailsPanel).update_stats(live)
        self._report(outcome)
        if reply.edit is not None and outcome.finish_reason in COMPLETE_REASONS:
            self.offer_edit(reply.edit[0], reply.view.text, reply.edit[1])

    async def stop_generation(self) -> None:
        """Cancel the running reply, wait for its worker thread to end, and finish it (partial text kept)."""
        reply = self._active
        if reply is None:
            return
        reply.cancel.set()
        if reply.live.prefill is not None and not reply.live.stats.new_tokens:
            reply.view.show_status("stopping after the current pass over the prompt…")  # Esc was heard
        if reply.worker is not None:
            try:
                await reply.worker.wait()
            except (WorkerCancelled, WorkerFailed, WorkerError):
                pass  # run_generation never raises; a cancelled worker means the app is shutting down
        await self._drain(reply)
        if not reply.finished:
            await self._finish(reply, ReplyOutcome("cancelled"))
