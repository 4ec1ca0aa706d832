"""Saving a reply while it streams: :class:`StreamingSaver` keeps one message of a :class:`~.store.ChatStore` at
most ``interval_s`` behind the text appended so far, from a background thread (its docstring has the contract).
"""

from __future__ import annotations

import logging
import threading
import time

from specchat.app.chat.history.records import StoreError
from specchat.app.chat.history.store import ChatStore
from specchat.backend.errors import SpecchatError

log = logging.getLogger(__name__)


class StreamingSaver:
    """Saves one reply (an existing message) while its tokens stream in.

    ``append`` only buffers: it never touches SQLite, so decoding never waits on the disk or on another
    process's lock. A daemon flusher thread writes the whole text so far whenever part of it is unsaved, at most
    once per ``0.8 * interval_s`` (the remaining fifth of ``interval_s`` is the margin for the write itself), so
    the text on disk is never more than ``interval_s`` behind what was appended — also when the stream pauses:
    the flusher does not wait for another token. ``finish`` stops the thread and writes the final text with its
    stats and ``complete`` flag. A failed background write is retried at the next tick, kept in ``error``, and
    the final write in ``finish`` raises :class:`StoreError` if it fails too.
    """

    def __init__(self, store: ChatStore, message_id: int, interval_s: float = 0.5, *, initial_text: str = "") -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s!r}")
        self.store = store
        self.message_id = message_id
        self.interval_s = interval_s
        self.error: StoreError | None = None
        self._period = 0.8 * interval_s
        self._parts = [initial_text]
        self._dirty = False
        self._stopping = False
        self._last_snapshot = float("-inf")  # time.monotonic() of the last snapshot written
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"specchat-saver-{message_id}", daemon=True)
        self._thread.start()

    @property
    def text(self) -> str:
        with self._cond:
            return "".join(self._parts)

    def append(self, text: str) -> None:
        if not text:
            return
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"StreamingSaver for message {self.message_id} was already finished")
            self._parts.append(text)
            if not self._dirty:
                self._dirty = True
                self._cond.notify()

    def _snapshot(self) -> str:  # called with the condition held
        text = "".join(self._parts)
        self._parts = [text]
        self._dirty = False
        self._last_snapshot = time.monotonic()
        return text

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._dirty or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                delay = self._last_snapshot + self._period - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)  # finish() may wake us early; re-evaluate either way
                    continue
                text = self._snapshot()
            try:
                self.store.update_message(self.message_id, text, complete=False)
            except SpecchatError as exc:
                if self.error is None:
                    log.warning("could not save the streaming reply: %s", exc)
                self.error = exc if isinstance(exc, StoreError) else StoreError(str(exc))
                with self._cond:
                    self._dirty = True  # retry at the next tick

    def finish(self, stats: dict | None = None, complete: bool = True, text: str | None = None) -> str:
        """Stop the flusher and write the final text (``text`` when given, else all that was appended) with
        ``stats`` and ``complete``; returns the text written. Calling it again writes again."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        with self._cond:
            if text is not None:
                self._parts = [text]
            final = "".join(self._parts)
        self.store.update_message(self.message_id, final, stats=stats, complete=complete)
        return final
