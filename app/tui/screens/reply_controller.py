"""The chat screen's streaming reply: a non-visual widget that owns the reply being written and its worker.

Contract:
- One generation at a time: a thread worker (group "generate") runs :func:`run_generation`; the worker only
  fills a :class:`ReplyBuffer` and posts :class:`ReplyProgress` nudges (≤ ~10 a second) to this widget. Every
  widget update happens here, on the UI thread, when a nudge is drained.
- The UI must not slow decoding: the engine competes for the same cores (a parallel torch op waits for its
  slowest thread, so a busy UI thread costs decoding more than its own share) and for the GIL. So each nudge
  redraws only the stats bar (one line, no layout pass); the reply's text is drawn at most every
  ``text_interval`` (0.25 s, up to 1 s), mostly as a repaint of the message's StreamTail: a layout pass of
  the screen (the dearest thing the UI does) comes only when the tail takes its next step of height. Every second
  the UI thread's CPU share is checked: above ``UI_CPU_BUDGET`` of a core the text interval grows, then the
  nudge interval (0.1 s, up to 0.25 s); below half of it they shrink back, in the reverse order. New text is
  handed to the StreamingSaver at every nudge, however rarely it is drawn. The widgets it draws into are
  handed to it (:class:`ReplyViews`): no DOM query per nudge (each one is UI-thread time taken from decoding;
  the costs: ``benchmarks/RESULTS.md``, "Figures moved out of the code").
- No torch op runs on the UI thread. A thread that runs one gets its own OpenMP team; with two teams alive libgomp has
  more threads than cores and stops spinning between parallel regions, and decoding in the worker slows
  (``benchmarks/RESULTS.md``, "The chat UI against `specchat generate`"). The loader thread's team goes away when it
  ends, before any reply starts.
- Stop (Esc), regenerate, send, new/open chat and pair switches call :meth:`ReplyController.stop` first: it sets
  the cancel event, waits for the worker thread to end, drains what is left and finishes the reply (the
  partial text is kept, shown and saved) before anything else starts.
- A reply is saved while it streams (StreamingSaver, ≤ 0.5 s behind) and at its end with its stats.
- A reply asks the engine for prefill progress: until its first token, the stats bar and the reply's totals
  line say "reading prompt 2,300 / 4,936 tokens" (redrawn each second for the time so far); Esc stops it
  between two passes over the prompt.
- A reply asked while its pair is still loading waits for it (:meth:`ReplyController.engine_ready`).
- Errors become notifications that say what to do (Ctrl+R retries, Up edits the message and sends it again);
  the reply's totals line keeps what went wrong. The screen and the history stay usable.
- A complete reply to an ``/edit`` request is handed to ``offer_edit(targets, reply text, request)``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from textual import work
from textual.widget import Widget
from textual.worker import Worker, WorkerCancelled, WorkerError, WorkerFailed

from specchat.app.chat.edit_grammar import edit_constraint
from specchat.app.chat.editing import edit_prediction
from specchat.app.tui.bridge import LiveView, ReplyBuffer, ReplyOutcome, run_generation
from specchat.app.tui.messages import ReplyProgress
from specchat.app.tui.widgets.stats_bar import prefill_line, reply_totals
from specchat.backend.api import GenerationRequest
from specchat.backend.errors import KVCacheFullError, SpecchatError

if TYPE_CHECKING:
    from specchat.app.chat.conversation import Conversation, Turn
    from specchat.app.chat.editing import EditTarget
    from specchat.app.chat.history.saver import StreamingSaver
    from specchat.app.tui.seams import ChatHost
    from specchat.app.tui.widgets.conversation import ConversationView
    from specchat.app.tui.widgets.details_panel import DetailsPanel
    from specchat.app.tui.widgets.message_view import AssistantMessage
    from specchat.app.tui.widgets.prompt_input import PromptInput
    from specchat.app.tui.widgets.stats_bar import StatsBar
    from specchat.backend.api import EngineAPI

log = logging.getLogger("specchat.app.tui.screens.chat")

COMPLETE_REASONS = frozenset({"eos", "stop", "length", "context"})
UI_CPU_BUDGET = 0.03  # share of one core the UI thread may use while a reply streams
STATS_INTERVAL_S = (0.1, 0.25)  # the worker's nudges; each redraws the stats bar (one line, no layout pass)
TEXT_INTERVAL_S = (0.25, 1.0)  # how often the growing reply is redrawn (mostly a repaint of its tail)

EditRequest = tuple[list["EditTarget"], str]  # the /edit files and the request a reply answers
OfferEdit = Callable[[list["EditTarget"], str, str], object]  # (targets, reply text, request)


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


@dataclass(frozen=True)
class ReplyViews:
    """The chat screen's widgets a reply draws into."""

    conversation: ConversationView  # the reply's message is added here
    stats: StatsBar  # the live line, at every nudge
    details: DetailsPanel  # the per-position figures, while it is shown
    prompt: PromptInput  # its cursor does not blink while a reply streams (a blink repaints it)


@dataclass(eq=False)
class ActiveReply:
    reply_id: int
    turn: Turn
    view: AssistantMessage
    saver: StreamingSaver | None
    edit: EditRequest | None  # the /edit files and request this reply answers
    buffer: ReplyBuffer = field(default_factory=ReplyBuffer)
    cancel: threading.Event = field(default_factory=threading.Event)
    worker: Worker[None] | None = None
    live: LiveView = field(default_factory=LiveView)
    finished: bool = False
    shown_at: float = float("-inf")  # time.monotonic() of the last redraw of its text


class ReplyController(Widget):
    DEFAULT_CSS = "ReplyController { display: none; }"

    def __init__(self, host: ChatHost, conv: Conversation, views: ReplyViews, offer_edit: OfferEdit) -> None:
        super().__init__()
        self._host, self._conv, self._views, self._offer_edit = host, conv, views, offer_edit
        self._active: ActiveReply | None = None
        self._replies: dict[int, ActiveReply] = {}
        self._ids = itertools.count(1)
        self._drain_lock = asyncio.Lock()
        self._waiting = False  # a reply to start once the model has loaded
        self._waiting_edit: EditRequest | None = None  # the /edit files of that reply
        self._last = LiveView()  # the last finished reply's, for the details panel
        self.stats_interval, self.text_interval = STATS_INTERVAL_S[0], TEXT_INTERVAL_S[0]
        self._cpu_mark = (time.thread_time(), time.monotonic())

    def on_mount(self) -> None:
        self.set_interval(1.0, self._tick)

    @property
    def generating(self) -> bool:
        return self._active is not None

    @property
    def live(self) -> LiveView:
        """What the details panel shows: the streaming reply's figures, else the last finished reply's."""
        return self._active.live if self._active else self._last

    # -- starting ----------------------------------------------------------------------------------------------
    def _local(self) -> bool:
        """Whether the pair decodes here (a constraint's grammar goes to llguidance; a server's API takes none)."""
        pair = self._host.current_pair
        return pair is not None and getattr(pair, "remote", None) is None

    async def start(self, edit: EditRequest | None = None) -> None:
        """Answer the conversation's last message (``edit``: the /edit files and request it carries); when the
        pair is still loading, the reply starts once it is ready."""
        engine = self._host.engine
        if engine is None:
            if self._host.loading_pair:
                self._waiting, self._waiting_edit = True, edit
                self.notify(
                    f"{self._host.loading_pair} is still loading; the reply starts when it is ready.", timeout=4
                )
            else:
                self.notify(
                    "No model is loaded. Choose a model pair with F2, then press Ctrl+R to answer.",
                    title="No model",
                    severity="error",
                    timeout=8,
                )
            return
        settings = self._host.settings
        request = GenerationRequest(
            messages=self._conv.request_messages(settings.system_prompt),
            sampling=settings.sampling(),
            drafter=settings.request_drafter(self._host.current_pair_name),
            gamma=settings.gamma,
            conversation=self._conv.key,
            prefill_progress=True,
            prediction=edit_prediction(edit[0]) if edit else None,  # a whole-file /edit: drafted from the file
            constraint=edit_constraint(edit[0]) if edit and self._local() else None,  # blocks: SEARCH from the file
        )
        turn, saver = self._conv.start_reply()
        view = await self._views.conversation.add_reply(f"Assistant · {self._host.current_pair_name}")
        reply = ActiveReply(next(self._ids), turn, view, saver, edit)
        self._replies[reply.reply_id] = reply
        self._active = reply
        self._cpu_mark = (time.thread_time(), time.monotonic())
        self._views.prompt.cursor_blink = False  # a blink repaints the input twice a second
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
        """The pair finished loading: start a reply that was waiting for it."""
        if self._waiting:
            self._waiting = False
            await self.start(self._waiting_edit)

    def engine_unavailable(self) -> None:
        """The pair failed to load: a reply that was waiting for it will not start."""
        if self._waiting:
            self._waiting = False
            self.notify("Your message is kept; press Ctrl+R to answer it once a model is loaded.", timeout=8)

    def forget_waiting(self) -> None:
        """Another chat is shown: a reply waiting for the pair is no longer wanted."""
        self._waiting = False

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
            line = getattr(self._host.engine, "start_line", None)  # the path may change between replies
            if self._views.stats.set_path(line):
                if str(line).startswith("CPU native"):
                    self.notify(f"Now running on {line}", title="CPU kernels ready", timeout=10)
                else:
                    self.notify(f"Now running on {line}", title="Slower path", severity="warning", timeout=10)
            self._views.stats.show_live(delta.live, streaming=delta.outcome is None)
            if delta.outcome is None:
                self._show_prefill(reply)
            details = self._views.details
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
            self._views.stats.show_live(reply.live, streaming=True)
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

    # -- ending ----------------------------------------------------------------------------------------------
    async def _finish(self, reply: ActiveReply, outcome: ReplyOutcome) -> None:
        reply.finished = True
        self._replies.pop(reply.reply_id, None)
        if self._active is reply:
            self._active = None
            self._views.prompt.cursor_blink = True
        prefill = reply.live.prefill  # how much of the prompt was read, for a reply stopped before its first token
        if outcome.stats is not None:  # the engine's totals (a stop before its last event keeps the latest stats)
            stopped_early = prefill if not outcome.stats.new_tokens else None
            reply.live = LiveView(outcome.stats, reply.live.drafter, None, stopped_early)
        live, stats = reply.live, reply.live.stats
        error = (outcome.message or "unknown error") if outcome.finish_reason == "error" else None
        read = (prefill[0], prefill[1]) if prefill is not None else None
        elapsed = time.monotonic() - prefill[2] if prefill is not None else None
        await reply.view.finish(reply_totals(stats, outcome.finish_reason, error, read, elapsed))
        complete = outcome.finish_reason in COMPLETE_REASONS
        self._conv.finish_reply(
            reply.turn,
            reply.saver,
            reply.view.text,
            stats,
            finish_reason=outcome.finish_reason,
            pair=self._host.current_pair_name or "",
            complete=complete,
            error=error,
        )
        self._last = live
        self._views.stats.show_live(live, streaming=False)
        self._views.details.update_stats(live)
        self._report(outcome)
        if reply.edit is not None and outcome.finish_reason in COMPLETE_REASONS:
            self._offer_edit(reply.edit[0], reply.view.text, reply.edit[1])

    async def stop(self) -> None:
        """Cancel the running reply, wait for its worker thread to end, and finish it (partial text kept)."""
        reply = self._active
        if reply is None:
            return
        reply.cancel.set()
        if reply.live.prefill is not None and not reply.live.stats.new_tokens:
            reply.view.show_status("stopping…")  # Esc was heard: the engine stops within one layer of its pass
        if reply.worker is not None:
            try:
                await reply.worker.wait()
            except (WorkerCancelled, WorkerFailed, WorkerError):
                pass  # run_generation never raises; a cancelled worker means the app is shutting down
        await self._drain(reply)
        if not reply.finished:
            await self._finish(reply, ReplyOutcome("cancelled"))

    def _report(self, outcome: ReplyOutcome) -> None:
        """Say how a reply that did not simply end went, and what to do."""
        reason, error = outcome.finish_reason, outcome.error
        if reason == "error":
            if isinstance(error, KVCacheFullError):
                self.notify(
                    f"{error} Start a new chat (Ctrl+N) or shorten the conversation; the partial reply was kept.",
                    title="Context full",
                    severity="error",
                    timeout=12,
                )
            elif error is None or isinstance(error, SpecchatError):
                reason_text = (outcome.message or "unknown error").rstrip(".")
                self.notify(
                    f"{reason_text}. The partial reply was kept; press Ctrl+R to try again, or ↑ in the empty "
                    "input to edit your message and send it again.",
                    title="Reply failed",
                    severity="error",
                    timeout=12,
                )
            else:
                log.error("unexpected error during a reply", exc_info=error)
                self.notify(
                    f"Internal error: {type(error).__name__}: {error}. The partial reply was kept; the "
                    f"traceback is in {self._host.log_path}.",
                    title="Reply failed",
                    severity="error",
                    timeout=12,
                )
        elif reason == "context":
            self.notify(
                outcome.message
                or "The conversation no longer fits in the model's context. Start a new chat (Ctrl+N) to go on.",
                title="Context full",
                severity="warning",
                timeout=12,
            )
        elif outcome.message:
            self.notify(outcome.message, timeout=6)
