"""The deadlines of one remote request, enforced from a thread: httpx's read timeout restarts with every byte (a
keep-alive comment, a lying Content-Length's trickle), so it cannot bound a request on its own.

Contract: :class:`Watchdog` ``(cancel, no_progress_s, deadline_s)`` watches one request from its start. Every
:data:`POLL_S` it checks, in this order: ``cancel`` set; the request running past ``deadline_s``; no
:meth:`progress` (a new token) for ``no_progress_s`` (from the start for the first token). On the first that
holds it records :attr:`reason` (``"cancelled"``, ``"deadline"``, ``"no_progress"``) and shuts the request's
socket down, so a read blocked on it returns at once; the caller reads :attr:`reason` to say why. The socket is
taken from httpcore's trace of the TCP connect (:meth:`trace`, passed as the request's ``trace`` extension), or
from the response once it came (:meth:`watch_response`: a kept-alive connection opens no new socket; before its
answer, httpx's read timeout, set to ``no_progress_s``, is the bound). :meth:`stop` ends the watch.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Literal

import httpx

POLL_S = 0.05
Reason = Literal["cancelled", "deadline", "no_progress"]


class Watchdog:
    """See the module docstring."""

    def __init__(self, cancel: threading.Event, no_progress_s: float, deadline_s: float) -> None:
        self.cancel, self.no_progress_s, self.deadline_s = cancel, no_progress_s, deadline_s
        self.start = self.last_progress = time.monotonic()
        self.reason: Reason | None = None
        self._socket: socket.socket | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="specchat-remote-watchdog", daemon=True)
        self._thread.start()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace callback: keeps the socket of the connection opened for this request."""
        if event == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            self._keep(stream.get_extra_info("socket") if stream is not None else None)

    def watch_response(self, response: httpx.Response) -> None:
        stream = response.extensions.get("network_stream")
        self._keep(stream.get_extra_info("socket") if stream is not None else None)

    def progress(self) -> None:
        """A new token came."""
        self.last_progress = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _keep(self, sock: Any) -> None:
        if isinstance(sock, socket.socket):
            with self._lock:
                self._socket = sock
                if self.reason is not None:  # fired before the socket was known
                    self._shut()

    def _expired(self) -> Reason | None:
        now = time.monotonic()
        if self.cancel.is_set():
            return "cancelled"
        if now - self.start > self.deadline_s:
            return "deadline"
        if now - self.last_progress > self.no_progress_s:
            return "no_progress"
        return None

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            reason = self._expired()
            if reason is not None:
                with self._lock:
                    if not self._done.is_set():
                        self.reason = reason
                        self._shut()
                return

    def _shut(self) -> None:
        if self._socket is not None:
            try:
                self._socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
