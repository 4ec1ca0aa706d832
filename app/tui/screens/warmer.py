"""Reading a reopened chat into the engine's cache before the user sends: a non-visual widget of the chat screen.

Why: the engine keeps each conversation's K/V by its key (``Conversation.key``: ``chat-<id>``, the same whenever
the chat is open), so the next reply reads only what is new, but a chat reopened from the history after a restart
(or under another pair) is not cached: its next reply read the whole conversation first, tens of seconds for a
long chat on a busy CPU (issue 36; ``benchmarks/RESULTS.md``, "Figures moved out of the code"). Contract:

- :meth:`ChatWarmer.start` (a chat was opened, or a pair loaded under one): when the engine runs here (not a remote
  pair) and the chat has messages, one request of the chat's messages with ``max_new_tokens=1`` runs in a thread
  worker under the chat's key, with prefill progress: the engine keeps what it reads, up to what memory allows
  (its pool evicts the least recently used conversations first). A chat still cached costs a few tokens.
- Progress and the outcome are drawn in the stats bar ("reading 1,024 / N tokens", then "N tokens read in
  T s (R tok/s)" or "still cached"). The token it samples is dropped; nothing reaches the conversation.
- :meth:`ChatWarmer.stop` cancels it (the engine stops between two layers) and waits for the worker: the chat
  screen calls it before a reply starts and before another chat is shown (the engine has one owner at a time).
  What was read before the stop stays cached, so the reply goes on from there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.widget import Widget
from textual.worker import Worker, WorkerCancelled, WorkerError, WorkerFailed

from specchat.app.tui.messages import WarmProgress
from specchat.app.tui.widgets.stats_bar import percent_bar, prefill_line, seconds
from specchat.backend.api import GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from specchat.app.chat.conversation import Conversation
    from specchat.app.tui.seams import ChatHost
    from specchat.app.tui.widgets.stats_bar import StatsBar
    from specchat.backend.api import EngineAPI

log = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 0.25


class ChatWarmer(Widget):
    DEFAULT_CSS = "ChatWarmer { display: none; }"

    def __init__(self, host: ChatHost, conv: Conversation, stats: StatsBar) -> None:
        super().__init__()
        self._host, self._conv, self._stats = host, conv, stats
        self._cancel = threading.Event()
        self._worker: Worker[None] | None = None
        self._key: str | None = None  # the conversation being read

    @property
    def running(self) -> bool:
        return self._worker is not None and not self._worker.is_finished

    def start(self) -> None:
        """Read the open chat into the engine's cache in the background (see the module docstring)."""
        engine, pair = self._host.engine, self._host.current_pair
        if engine is None or not self._conv.turns or getattr(pair, "remote", None) is not None or self.running:
            return
        messages = self._conv.request_messages(self._host.settings.system_prompt)
        if not messages:
            return
        self._cancel, self._key = threading.Event(), self._conv.key
        request = GenerationRequest(
            messages=messages,
            sampling=SamplingParams(max_new_tokens=1),
            conversation=self._key,
            prefill_progress=True,
        )
        self._worker = self._read(engine, request, self._cancel)

    async def stop(self) -> None:
        """Cancel the reading and wait for it to end (what it read stays cached)."""
        worker = self._worker
        if worker is None:
            return
        self._cancel.set()
        try:
            await worker.wait()
        except (WorkerCancelled, WorkerFailed, WorkerError):
            pass  # _read never raises; a cancelled worker means the app is shutting down
        self._worker, self._key = None, None  # its last messages are not drawn over what comes next

    @work(thread=True, exclusive=True, group="warm", exit_on_error=False)
    def _read(self, engine: EngineAPI, request: GenerationRequest, cancel: threading.Event) -> None:
        key, started, last = request.conversation or "", time.monotonic(), 0.0
        done = total = cached = 0
        seconds_read: float | None = None
        try:
            for event in engine.generate(request, cancel):
                if event.prefill_done is not None:
                    done, total = event.prefill_done, event.prefill_tokens
                    now = time.monotonic()
                    if now - last >= PROGRESS_INTERVAL_S:
                        last = now
                        self.post_message(WarmProgress(key, done, total, started))
                elif event.stats is not None and event.is_prefill:
                    stats = event.stats
                    done = total = stats.prefill_tokens or 0
                    cached, seconds_read = stats.prompt_tokens - done, stats.prefill_s
                    cancel.set()  # the one token it samples is not wanted
        except Exception:  # noqa: BLE001 - warming is an optimisation: the reply reads the prompt itself
            log.exception("reading the chat into the cache failed")
        finished = seconds_read is not None
        self.post_message(WarmProgress(key, done, total, started, True, cached, seconds_read, not finished))

    def on_warm_progress(self, message: WarmProgress) -> None:
        if message.key != self._key or self._host.engine is None:
            return
        if not message.finished:
            line = prefill_line(message.done, message.total, time.monotonic() - message.started)
            text = Text.assemble(
                ("preparing this chat: ", "cyan"),
                (line, "bold cyan"),
                f" {percent_bar(message.done / message.total if message.total else 0.0)}",
                ("  Enter sends anyway", "dim"),
            )
        elif message.cancelled:
            text = Text(f"this chat's first {message.done:,} tokens are read", style="dim")
        elif message.done <= message.cached:  # the engine held nearly all of it already
            text = Text(f"this chat is ready: its {message.cached:,} tokens were still cached", style="dim")
        else:
            took = message.seconds or 0.0
            rate = f" ({message.done / took:,.0f} tok/s)" if took > 0 else ""
            text = Text(f"this chat is ready: {message.done:,} tokens read in {seconds(took)}{rate}", style="dim")
        self._stats.show_note(text)
