"""The remote client (backend/remote/) against a server that misbehaves in every way we could think of, on
127.0.0.1 (issue 37): refused and reset connections, silence, garbage, lying lengths, bad gzip, HTML pages, huge
bodies and lines, endless streams, broken chunks, terminal escapes. Every fault ends as a one-line RemoteError
naming the server and what to check, or as a reply whose last event says what happened; never an httpx
traceback, never a password, never a control character, never more than max_new_tokens tokens, never a hang."""

from __future__ import annotations

import json
import time

import pytest
from faulty_server import (
    Conn,
    chunk,
    endless,
    faulty_server,
    good_stream,
    gzip_bytes,
    response,
    sse,
    stream,
)
from reliability import FUZZED
from serve_fixtures import remote_pair

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.errors import RemoteError
from specchat.backend.remote.client import RemoteEngine, check_server

MAX_NEW = 16
PASSWORD = "s3cr3t-pw"
CONTROL = [chr(c) for c in range(32) if chr(c) not in "\n\t"] + ["\x7f", "\x9b"]


def _html(status: int) -> object:
    page = b"<!DOCTYPE html><html><body><h1>Login</h1>\x1b[31mred</body></html>"
    return lambda conn: conn.send(response(status, page, {"Content-Type": "text/html"}))


def _json(status: int, payload: object) -> object:
    body = json.dumps(payload).encode()
    return lambda conn: conn.send(response(status, body, {"Content-Type": "application/json"}))


def _raw(data: bytes, *, reset: bool = False) -> object:
    def run(conn: Conn) -> None:
        conn.send(data)
        if reset:
            conn.reset()

    return run


def _huge_error(conn: Conn) -> None:  # a 600 MB error body, streamed until the client leaves
    if conn.send(response(500, b"", {"Content-Type": "text/plain"}, length=600 << 20)):
        while conn.sent < (600 << 20) and conn.send(b"x" * 65536):
            pass


def _stall(seconds: float, first: bytes = b"") -> object:
    def run(conn: Conn) -> None:
        if first:
            conn.send(first)
        time.sleep(seconds)

    return run


def _token(i: int) -> bytes:
    return sse(chunk("w ", ids=[i]))


BEHAVIOURS: dict[str, object] = {
    # the connection
    "closes at once": lambda conn: None,
    "resets at once": lambda conn: conn.reset(),
    "silent (read timeout)": _stall(3.0),
    "not HTTP": _raw(b"SSH-2.0-OpenSSH_9.0\r\n"),
    "TLS bytes": _raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40),
    "half a status line": _raw(b"HTTP/1.1 20"),
    "status line only": _raw(b"HTTP/1.1 200 OK\r\n"),
    "HTTP/0.9 body": _raw(b"data: hello\n\n"),
    "bad status code": _raw(b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n"),
    "bad header line": _raw(b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"),
    "headers then reset": _raw(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n", reset=True),
    "100 then close": _raw(b"HTTP/1.1 100 Continue\r\n\r\n"),
    "two lengths": _raw(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 9\r\n\r\nhello"),
    "length 1e30": _raw(b"HTTP/1.1 200 OK\r\nContent-Length: 1e30\r\n\r\n"),
    "headers only then silence": _stall(3.0, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"),
    # lying lengths and encodings
    "length longer than body": lambda c: c.send(
        response(200, good_stream(), {"Content-Type": "text/event-stream"}, length=99999)
    ),
    "length longer, stream cut": lambda c: c.send(
        response(200, sse(chunk("a")), {"Content-Type": "text/event-stream"}, length=99999)
    ),
    "length shorter than body": lambda c: c.send(
        response(200, good_stream(), {"Content-Type": "text/event-stream"}, length=20)
    ),
    "error length longer": lambda c: c.send(
        response(500, b'{"error": "x"}', {"Content-Type": "application/json"}, length=5000)
    ),
    "bad gzip stream": stream(b"this is not gzip at all", {"Content-Encoding": "gzip"}),
    "bad gzip error": lambda c: c.send(response(500, b"nope", {"Content-Encoding": "gzip"})),
    "bad deflate": stream(b"\x00\x01\x02", {"Content-Encoding": "deflate"}),
    "good gzip stream": stream(gzip_bytes(good_stream()), {"Content-Encoding": "gzip"}),
    "unknown coding": stream(good_stream(), {"Content-Encoding": "br-weird"}),
    "bad chunk size": _raw(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    ),
    "chunked cut off": _raw(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(sse(chunk("w")))
        + sse(chunk("w"))
        + b"\r\n"
    ),
    # what kind of answer
    "HTML 200": _html(200),
    "JSON 200 error": _json(200, {"error": {"message": "quota \x1b[2J exceeded"}}),
    "JSON 200 whole completion": _json(
        200, {"choices": [{"index": 0, "message": {"content": "whole"}, "finish_reason": "stop"}]}
    ),
    "JSON 200 list": _json(200, [1, 2, 3]),
    "text/plain 200": lambda c: c.send(response(200, b"hello", {"Content-Type": "text/plain"})),
    "204": lambda c: c.send(response(204)),
    "301 redirect": lambda c: c.send(response(301, b"", {"Location": "http://127.0.0.1:1/elsewhere"})),
    "600 MB error body": _huge_error,
    # streams that go wrong
    "empty stream": stream(b""),
    "DONE only": stream(sse(b"[DONE]")),
    "comments only": stream(b": keep-alive\n\n" * 50),
    "no finish": stream(sse(chunk("a"), chunk("b"), b"[DONE]")),
    "ends mid-stream": stream(sse(chunk("a"), chunk("b"))),
    "not JSON chunk": stream(sse(chunk("a"), b"{oops")),
    "JSON array chunk": stream(sse(b"[1, 2]", chunk("", finish="stop"))),
    "deep JSON": stream(sse(b"[" * 100_000 + b"]" * 100_000)),
    "NaN figures": stream(sse(b'{"choices": [], "usage": {"prompt_tokens": NaN, "completion_tokens": -5}}')),
    "error chunk": stream(sse(chunk("a"), {"error": {"message": "boom\x1b[31m\r\nsecond line"}})),
    "error string chunk": stream(sse({"error": "plain"})),
    "choices not a list": stream(sse({"choices": "x"}, chunk("", finish="stop"))),
    "delta a string": stream(sse({"choices": [{"delta": "x"}]}, chunk("", finish="stop"))),
    "ids not ints": stream(sse(chunk("a", ids=["1", None, 2.5, True]), chunk("", finish="stop"))),
    "bogus finish": stream(sse(chunk("a", finish="exploded"))),
    "bogus specchat block": stream(
        sse(chunk("a", ids=[1], specchat={"sources": [9], "stats": {"new_tokens": "many"}}), chunk("", finish="stop"))
    ),
    "escapes in text": stream(sse(chunk("\x1b]0;pwned\x07\x1b[2Jhi\r\x9b31m"), chunk("", finish="stop"))),
    "escapes in token texts": stream(
        sse(
            chunk("ab", ids=[1, 2], specchat={"sources": [0, 1], "token_texts": ["a\x1b", "b"]}),
            chunk("", finish="stop"),
        )
    ),
    "NUL and bad UTF-8": stream(b"data: " + json.dumps(chunk("x\x00y")).encode() + b"\xff\xfe\n\n"),
    "CR line ends": stream(good_stream().replace(b"\n", b"\r\n")),
    "huge line": stream(b"data: " + b"a" * (3 << 20) + b"\n\n"),
    "endless line": endless(lambda i: b"a" * 65536),
    "endless tokens": endless(_token),
    "endless text without ids": endless(lambda i: sse(chunk("w"))),
    "endless empty chunks": endless(lambda i: sse({"choices": []})),
    "endless comments": endless(lambda i: b": ping\n\n" * 100),
    "too many ids in one chunk": stream(sse(chunk("w " * 100, ids=list(range(100))), chunk("", finish="stop"))),
    "slow then stall": endless(_token, pause_s=3.0),
}
STATUSES = [400, 401, 403, 404, 405, 408, 413, 422, 429, 500, 502, 503, 504]
for _status in STATUSES:
    BEHAVIOURS[f"{_status} HTML"] = _html(_status)
    BEHAVIOURS[f"{_status} JSON"] = _json(_status, {"error": {"message": f"said {_status}\x1b[0m", "type": "x"}})
    BEHAVIOURS[f"{_status} empty"] = lambda c, s=_status: c.send(response(s))
    BEHAVIOURS[f"{_status} garbage"] = lambda c, s=_status: c.send(response(s, bytes(range(256)) * 4))


@pytest.fixture(scope="module")
def faulty():
    with faulty_server() as server:
        yield server


def _check_message(text: str, url: str) -> None:
    assert "\n" not in text and "Traceback" not in text and PASSWORD not in text, text
    assert not any(c in text for c in CONTROL), repr(text)
    assert "127.0.0.1" in text and len(text) < 1200, text


@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_a_faulty_server_ends_in_one_line_or_a_marked_reply(faulty, tmp_path, name) -> None:
    faulty.behaviour = BEHAVIOURS[name]
    url = f"http://user:{PASSWORD}@127.0.0.1:{faulty.port}/v1"
    engine = RemoteEngine(remote_pair(tmp_path, url, kind="vllm", no_progress_s=1.0))
    request = GenerationRequest(
        messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_new_tokens=MAX_NEW)
    )
    start = time.monotonic()
    events = []
    try:
        for event in engine.generate(request):
            events.append(event)
    except RemoteError as error:
        _check_message(str(error), url)
    finally:
        engine.close()
    FUZZED["remote: faulty server behaviours"] += 1
    assert time.monotonic() - start < 20, name
    if events:
        last = events[-1]
        assert last.finish_reason is not None
        if last.message:
            _check_message(last.message, url)
        assert sum(len(e.token_ids) or bool(e.text) for e in events[:-1]) <= MAX_NEW
        for event in events:
            assert not any(c in event.text for c in CONTROL), repr(event.text)
            assert not any(c in t for t in event.token_texts for c in CONTROL)
    if name == "600 MB error body":
        assert faulty.last[-1].sent < 64 << 20  # the client read its cap and left


@pytest.mark.parametrize("name", [n for n in BEHAVIOURS if "endless" not in n and "silent" not in n])
def test_the_reachability_check_never_raises(faulty, name) -> None:
    from specchat.backend.models.catalog.config import RemoteSpec

    faulty.behaviour = BEHAVIOURS[name]
    spec = RemoteSpec(server=f"http://u:{PASSWORD}@127.0.0.1:{faulty.port}/v1", model="m")
    result = check_server(spec, "p", timeout_s=1.0)
    FUZZED["remote: faulty server behaviours"] += 1
    if result["error"]:
        assert PASSWORD not in result["error"] and "\n" not in result["error"]
        assert not any(c in result["error"] for c in CONTROL), repr(result["error"])


def test_the_expected_outcomes_of_some_faults(faulty, tmp_path) -> None:
    url = f"http://user:{PASSWORD}@127.0.0.1:{faulty.port}/v1"
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_new_tokens=8))

    def run(name: str) -> tuple[list, str]:
        faulty.behaviour = BEHAVIOURS[name]
        engine = RemoteEngine(remote_pair(tmp_path, url, kind="vllm", no_progress_s=1.0))
        try:
            return list(engine.generate(request)), ""
        except RemoteError as error:
            return [], str(error)
        finally:
            engine.close()

    events, error = run("HTML 200")
    assert "HTML page" in error and "ending in /v1" in error and "user:***@127.0.0.1" in error
    events, _ = run("endless tokens")
    assert events[-1].finish_reason == "length" and "cut" in (events[-1].message or "")
    assert sum(len(e.token_ids) for e in events) == 8
    events, _ = run("escapes in text")
    assert "".join(e.text for e in events) == "hi"  # whole sequences go, not only their ESC
    events, _ = run("length longer, stream cut")
    assert events[-1].finish_reason == "error" and "Content-Length" in (events[-1].message or "")
    events, _ = run("bad gzip stream")
    assert "decompress" in (events[-1].message if events else error)
    events, _ = run("JSON 200 whole completion")
    assert "".join(e.text for e in events) == "whole" and events[-1].finish_reason == "eos"
    _, error = run("401 JSON")
    assert "API key refused: said 401" in error and "[0m" not in error and "\x1b" not in error
