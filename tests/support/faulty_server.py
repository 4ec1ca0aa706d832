"""A misbehaving HTTP server on 127.0.0.1 for the remote client's tests: each connection's request is read, then
handed to ``server.behaviour(conn)``, which answers however it likes (or not at all). Nothing but loopback."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

Behaviour = Callable[["Conn"], None]


@dataclass
class Conn:
    sock: socket.socket
    request: bytes
    sent: int = 0  # bytes written (what the client took before it closed)

    def send(self, data: bytes) -> bool:
        """Write ``data``; False when the client is gone."""
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        self.sent += len(data)
        return True

    def reset(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@dataclass
class FaultyServer:
    port: int
    behaviour: Behaviour = lambda conn: None
    last: list[Conn] = field(default_factory=list)


def _read_request(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(5)
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@contextlib.contextmanager
def faulty_server() -> Iterator[FaultyServer]:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    server = FaultyServer(listener.getsockname()[1])
    stop = threading.Event()

    def handle(sock: socket.socket) -> None:
        with sock:
            try:
                conn = Conn(sock, _read_request(sock))
                server.last.append(conn)
                sock.settimeout(30)
                server.behaviour(conn)
            except OSError:
                pass

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=handle, args=(sock,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(5)
        listener.close()


# -- answers ---------------------------------------------------------------------------------------------------


def response(
    status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, length: int | None = None
) -> bytes:
    head = [f"HTTP/1.1 {status} X"]
    fields = {"Content-Length": str(len(body) if length is None else length), "Connection": "close"}
    fields.update(headers or {})
    head += [f"{k}: {v}" for k, v in fields.items() if v is not None]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


SSE = {"Content-Type": "text/event-stream", "Content-Length": None}  # type: ignore[dict-item]


def chunk(content: str | None = "tok", *, finish: str | None = None, ids: list | None = None, **more) -> dict:
    choice: dict = {"index": 0, "delta": {"content": content} if content is not None else {}, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "x", "object": "chat.completion.chunk", "choices": [choice], **more}


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def stream(body: bytes, headers: dict | None = None) -> Behaviour:
    """An event stream answered in one write, then the connection closed."""
    return lambda conn: conn.send(response(200, body, {**SSE, **(headers or {})}))


def good_stream(n: int = 3) -> bytes:
    return sse(*[chunk("w") for _ in range(n)], chunk("", finish="stop"), b"[DONE]")


def gzip_bytes(data: bytes) -> bytes:
    return gzip.compress(data)


def endless(make: Callable[[int], bytes], pause_s: float = 0.0) -> Behaviour:
    """Headers, then ``make(i)`` for i = 0, 1, ... until the client leaves (at most 60 s)."""

    def run(conn: Conn) -> None:
        if not conn.send(response(200, b"", SSE)):
            return
        deadline = time.monotonic() + 60
        i = 0
        while time.monotonic() < deadline and conn.send(make(i)):
            i += 1
            if pause_s:
                time.sleep(pause_s)

    return run


# -- stalls: each would hold a client for STALL_S without its deadlines (issue 47) --------------------------------

STALL_S = 15.0


def _headers_then_silence(conn: Conn) -> None:
    conn.send(response(200, b"", SSE))
    time.sleep(STALL_S)


def _no_response(conn: Conn) -> None:
    time.sleep(STALL_S)


def _one_chunk_then_stall(conn: Conn) -> None:
    conn.send(response(200, sse(chunk("hello")), SSE))
    time.sleep(STALL_S)


def _lying_length(conn: Conn) -> None:
    conn.send(response(200, sse(chunk("hi")), {"Content-Type": "text/event-stream"}, length=99999))
    time.sleep(STALL_S)


def _keep_alive(conn: Conn) -> None:
    if conn.send(response(200, b"", SSE)):
        end = time.monotonic() + STALL_S
        while time.monotonic() < end and conn.send(b": keep-alive\n\n"):
            time.sleep(0.1)


def _empty_chunks(conn: Conn) -> None:
    if conn.send(response(200, b"", SSE)):
        end = time.monotonic() + STALL_S
        while time.monotonic() < end and conn.send(sse({"choices": [{"delta": {}}]})):
            time.sleep(0.1)


def _trickled_head(conn: Conn) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
        if not conn.send(bytes([byte])):
            return
        time.sleep(0.1)


def _tokens_forever(conn: Conn) -> None:
    if conn.send(response(200, b"", SSE)):
        end = time.monotonic() + STALL_S
        while time.monotonic() < end and conn.send(sse(chunk("w", ids=[1]))):
            time.sleep(0.1)


# name -> (behaviour, the deadline that ends it, whether a token came first)
STALLS = {
    "headers with no body": (_headers_then_silence, "no_progress", False),
    "no response": (_no_response, "no_progress", False),
    "stall after one chunk": (_one_chunk_then_stall, "no_progress", True),
    "lying Content-Length": (_lying_length, "no_progress", True),
    "keep-alive comment every 0.1 s": (_keep_alive, "no_progress", False),
    "empty chunks every 0.1 s": (_empty_chunks, "no_progress", False),
    "head trickled a byte at a time": (_trickled_head, "no_progress", False),
    "tokens past the deadline": (_tokens_forever, "deadline", True),
}


def timed_reply(engine, request) -> tuple[list, str, float]:
    """A remote engine's reply to ``request`` (then the engine closed): its events, the RemoteError's text ("" when
    none) and the seconds it took."""
    from specchat.backend.errors import RemoteError

    start = time.monotonic()
    events, error = [], ""
    try:
        events = list(engine.generate(request))
    except RemoteError as exc:
        error = str(exc)
    finally:
        engine.close()
    return events, error, time.monotonic() - start
