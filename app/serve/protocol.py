"""One HTTP/1.1 connection of `specchat serve`: uvicorn's h11 protocol with the guards a service needs.

Contract: :func:`guarded_protocol` ``(guard)`` returns the protocol class for ``uvicorn.Config(http=...)``. On top of
uvicorn's parsing, keep-alive timeout and flow control, a connection

- beyond ``guard.max_connections`` open at once is answered at once with a JSON 503 and closed (no thread, no
  queue: a connection costs a few kilobytes of the event loop, whatever the client does);
- gets ``guard.head_timeout_s`` from its start (or, on a kept-alive connection, from the next request's first
  byte) to a whole request head: else a JSON 408 (nothing when it sent nothing) and it is closed;
- whose client stops reading the reply for ``guard.write_timeout_s`` is aborted; the request's handler sees the
  disconnect and cancels the engine's work;
- that sends what h11 cannot parse (a malformed request line or header, ``Content-Length: 1e30``, two lengths, a
  transfer coding other than chunked, a head over ``guard.max_head_bytes``) gets a JSON 400 / 431 / 501 naming
  the problem, never uvicorn's text;
- whose client half-closes after a complete request (``shutdown(SHUT_WR)``) stays open for the reply, which is
  sent whole; the connection closes after it. A half-close and a full close look the same (a FIN), so until
  the reply starts the connection is probed every :data:`PROBE_S` with an interim ``100 Continue`` (which
  HTTP/1.1 clients skip): a client that really closed answers the probe with a reset, and its request is
  cancelled like any other that lost its client;
- closed while its client is still sending (a refusal before the body was read) is closed gracefully: the
  answer is sent, the sending side shut, and what the client still sends is read and dropped for up to
  :data:`LINGER_S` or :data:`LINGER_BYTES`, so that the client reads the answer rather than a reset.

Each refusal here is one access-log line (``guard.refused``); nothing here prints a traceback.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from specchat.app.serve.boundary import DEFAULT_MAX_CONNECTIONS

LINGER_S = 2.0  # how long a refused client may go on sending before its socket closes
LINGER_BYTES = 16 << 20  # how much of it is read and dropped meanwhile
PROBE_S = 0.5  # after a client's FIN: how often to check, until its reply starts, that it can still read
DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_WRITE_TIMEOUT_S = 60.0
DEFAULT_MAX_HEAD_BYTES = 16 << 10  # request line and headers


@dataclass(frozen=True)
class Guard:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    refused: Callable[[str, int, str], None] | None = None  # (client, status, why): the access log's line


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    """The OpenAI-style error object as bytes (the same shape as app/serve/boundary.py's)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


_BYTES = re.compile(r"""(?:bytearray\()?(b'(?:[^'\\]|\\.)*'|b"(?:[^"\\]|\\.)*")\)?""")


def _as_text(match: re.Match[str]) -> str:
    """A ``bytearray(b'...')`` or ``b'...'`` repr in h11's reason as the quoted text it holds (bytes that are not
    printable ASCII as \\xNN; a CRLF as CRLF)."""
    try:
        raw = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return match.group(0)
    shown = "".join(chr(b) if 32 <= b < 127 else "CRLF" if b == 13 else "" if b == 10 else f"\\x{b:02x}" for b in raw)
    return f"'{shown}'" if raw else "nothing"


def _printable(text: str, most: int = 120) -> str:
    text = _BYTES.sub(_as_text, text)
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= most else text[: most - 1] + "…"


def _hint(reason: str) -> str:
    """What to send instead, for the part of the request h11 could not parse."""
    lowered = reason.lower()
    if "chunk" in lowered:
        return (
            "send a chunked body as chunks of HEX-SIZE CRLF DATA CRLF ending with 0 CRLF CRLF, or send the body "
            "with a Content-Length instead"
        )
    if "request line" in lowered:
        if reason.startswith("illegal request line: '\\x16\\x03"):
            return "this server speaks plain HTTP: use http://, not https://"
        return "start with a request line such as 'POST /v1/chat/completions HTTP/1.1' (ASCII, single spaces)"
    if "content-length" in lowered or "transfer-encoding" in lowered:
        return "send one Content-Length of up to 19 digits, or Transfer-Encoding: chunked, for a body"
    if "header" in lowered or "host" in lowered:
        return "send each header as one 'Name: value' line (a name without spaces or controls) and one Host header"
    return (
        "send a GET or POST to /v1/... with a Host header and, for a body, one Content-Length of up to 19 digits "
        "or chunked encoding"
    )


class _Transport:
    """The socket's transport as uvicorn sees it: ``close()`` closes gracefully (see the module docstring)."""

    def __init__(self, inner: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._inner, self._protocol = inner, protocol

    def close(self) -> None:
        self._protocol.close_gracefully()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class GuardedProtocol(H11Protocol):
    """See the module docstring; :func:`guarded_protocol` binds a :class:`Guard` to it."""

    guard = Guard()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inner: asyncio.Transport | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._probe_timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._lingered = 0
        self._lost = False
        self._bytes_since_head = 0
        self._error: h11.RemoteProtocolError | None = None
        parse = self.conn.next_event

        def next_event() -> Any:  # keep h11's reason, which uvicorn's own 400 drops
            try:
                return parse()
            except h11.RemoteProtocolError as error:
                self._error = error
                raise

        self.conn.next_event = next_event  # type: ignore[method-assign]

    # -- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._inner = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > self.guard.max_connections:
            self._refuse(
                503,
                f"the server has {self.guard.max_connections} connections open, its limit (--max-connections); "
                "retry in a moment",
                "server_busy",
                {"retry-after": "1"},
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES and self._inner is not None:
                self._inner.close()
            return
        if self._waiting_for_head():
            self._bytes_since_head += len(data)
            self._arm_head_timer()
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a whole request head arrived
            self._cancel_head_timer()
            self._bytes_since_head = 0

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio's contract: True keeps it open
        cycle = self.cycle
        if not self._lingering and cycle is not None and not cycle.response_complete and not cycle.more_body:
            cycle.keep_alive = False  # a half-closed client: it gets its reply, then the connection closes
            self._probe_timer = self.loop.call_later(PROBE_S, self._probe)
            return True
        return None  # nothing (or half a request) was sent: close

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.guard.write_timeout_s, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # -- uvicorn's hooks ----------------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        error = self._error
        status = error.error_status_hint if error is not None else 400
        reason = _printable(str(error)) if error is not None else "malformed request"
        if status == 431:
            message = f"the request head is larger than {self.guard.max_head_bytes} bytes; send shorter headers"
        else:
            message = f"the request is not valid HTTP/1.1 ({reason}); {_hint(reason)}"
        self._refuse(status if status in (400, 431, 501) else 400, message)

    def shutdown(self) -> None:
        if self._lingering or self._inner is None:
            return
        try:
            super().shutdown()
        except h11.LocalProtocolError:
            self._inner.close()

    def timeout_keep_alive_handler(self) -> None:
        if self._inner is not None and not self._inner.is_closing():
            self._inner.close()

    # -- closing ------------------------------------------------------------------------------------------

    def close_gracefully(self) -> None:
        """uvicorn's ``transport.close()``: lingers while the client is still sending its request body."""
        inner = self._inner
        if inner is None or inner.is_closing() or self._lost:
            if inner is not None:
                inner.close()
            return
        if self.conn.their_state is h11.SEND_BODY:
            self._linger()
        else:
            inner.close()

    def _linger(self) -> None:
        inner = self._inner
        if inner is None or self._lingering:
            return
        self._lingering = True
        self._cancel_timers()
        try:
            if inner.can_write_eof():
                inner.write_eof()
            inner.resume_reading()
        except (OSError, RuntimeError):
            inner.close()
            return
        self.loop.call_later(LINGER_S, inner.close)

    def _refuse(self, status: int, message: str, kind: str = "invalid_request_error", extra: Any = None) -> None:
        """Answer ``status`` with a JSON error outside any request cycle, then close gracefully."""
        inner = self._inner
        if inner is None or inner.is_closing():
            return
        body = error_body(status, message, kind)
        head = [f"HTTP/1.1 {status} {STATUS_PHRASES[status].decode()}"]
        head += ["content-type: application/json", f"content-length: {len(body)}", "connection: close"]
        head += [f"{key}: {value}" for key, value in (extra or {}).items()]
        inner.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        if self.guard.refused is not None:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
            self.guard.refused(client, status, message)
        self._linger()

    # -- timers -------------------------------------------------------------------------------------------

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is None and not self._lingering:
            self._head_timer = self.loop.call_later(self.guard.head_timeout_s, self._head_expired)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        for timer in (self._write_timer, self._probe_timer):
            if timer is not None:
                timer.cancel()
        self._write_timer = self._probe_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self._waiting_for_head() or self._inner is None or self._inner.is_closing():
            return
        if self._bytes_since_head == 0:  # an idle connection: nobody to answer
            self._inner.close()
            return
        self._refuse(
            408,
            f"the request head did not arrive within {self.guard.head_timeout_s:g} s; send the request line "
            "and headers at once",
        )

    def _probe(self) -> None:
        self._probe_timer = None
        cycle, inner = self.cycle, self._inner
        if self._lost or inner is None or inner.is_closing() or cycle is None or cycle.response_started:
            return
        try:
            inner.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
        except h11.LocalProtocolError:
            return
        self._probe_timer = self.loop.call_later(PROBE_S, self._probe)

    def _write_expired(self) -> None:
        self._write_timer = None
        if self._inner is not None:
            self._inner.abort()  # uvicorn's connection_lost marks the cycle disconnected: the handler cancels


def guarded_protocol(guard: Guard) -> type[GuardedProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with ``guard``'s limits."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard})
