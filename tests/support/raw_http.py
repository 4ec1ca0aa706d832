"""Raw-socket HTTP clients for the hostile-client tests of `specchat serve` (127.0.0.1 only): send exact bytes
(malformed heads, lying lengths), half-close, reset, trickle, and read what comes back."""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass

HOST = "127.0.0.1"


@dataclass
class Answer:
    raw: bytes
    seconds: float
    reset: bool = False  # the server reset the connection

    @property
    def status(self) -> int | None:
        """The final status (interim 1xx skipped), None when no status line came."""
        rest = self.raw
        while rest.startswith(b"HTTP/1.1 1"):
            rest = rest.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in rest else b""
        if not rest.startswith(b"HTTP/1."):
            return None
        try:
            return int(rest.split(b" ", 2)[1])
        except (IndexError, ValueError):
            return None

    @property
    def body(self) -> bytes:
        rest = self.raw
        while rest.startswith(b"HTTP/1.1 1"):
            rest = rest.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in rest else b""
        head, _, body = rest.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            return _unchunk(body)
        for line in head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                return body[: int(line.split(b":", 1)[1])]  # a pipelined second answer may follow
        return body

    def json(self) -> dict:
        return json.loads(self.body)


def _unchunk(data: bytes) -> bytes:
    out = []
    while data:
        size_text, _, data = data.partition(b"\r\n")
        try:
            size = int(size_text.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out.append(data[:size])
        data = data[size + 2 :]
    return b"".join(out)


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=timeout)


def complete(raw: bytes) -> bool:
    """``raw`` holds a whole final response (by its Content-Length, or the last chunk of a chunked body)."""
    while raw.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in raw:
        raw = raw.split(b"\r\n\r\n", 1)[1]
    if b"\r\n\r\n" not in raw:
        return False
    head, _, body = raw.partition(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return b"transfer-encoding: chunked" in head.lower() and body.endswith(b"0\r\n\r\n")


def read_all(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Read until the server closes, a whole response came (a kept-alive connection), or ``timeout``; (bytes,
    whether the connection was reset)."""
    sock.settimeout(timeout)
    chunks, reset = [], False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            reset = True
            break
        except TimeoutError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        if complete(b"".join(chunks)):
            break
    return b"".join(chunks), reset


def exchange(port: int, data: bytes, *, half_close: bool = False, timeout: float = 10.0) -> Answer:
    """Send ``data`` (then shut the sending side when ``half_close``) and read the answer until close."""
    start = time.monotonic()
    with connect(port, timeout) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw, reset = read_all(sock, timeout)
    return Answer(raw, time.monotonic() - start, reset)


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (SO_LINGER 0), as a killed client's kernel may."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def post(path: str, body: bytes, *, extra: str = "", length: int | None = None) -> bytes:
    """A POST request's bytes (``length`` overrides Content-Length, for lying clients)."""
    size = len(body) if length is None else length
    head = f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n"
    return (head + extra + "\r\n").encode() + body


def thread_count() -> int:
    """Threads of this process (the kernel's count: Python's and the libraries' native ones)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0
