"""`specchat serve` against hostile and broken clients over raw sockets on 127.0.0.1 (issue 37): malformed
requests, lying lengths, slow, half-closed and reset clients, many idle connections, clients that leave. Each
gets a JSON answer naming the problem (or, when it left, nothing), fast; the server keeps no thread per client,
prints no traceback, and keeps answering. The counts go to the reliability summary."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
from fake_engine import FakeEngine, FakePair
from raw_http import Answer, connect, exchange, post, read_all, reset, thread_count
from reliability import FUZZED, READINGS
from serve_fixtures import running_server

from specchat.app.serve.boundary import Limits
from specchat.app.serve.protocol import Guard

CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
LONG_REPLY = "word " * 2000
GUARD = Guard(max_connections=64, head_timeout_s=1.0, write_timeout_s=2.0)


def _good() -> bytes:
    return post(CHAT, json.dumps(GOOD).encode())


def _body(value: object) -> bytes:
    return post(CHAT, json.dumps(value).encode())


# Requests a client may send by mistake or on purpose, each with the statuses that are a right answer.
BAD_HEADS: list[tuple[str, bytes, set[int]]] = [
    ("garbage", b"\x00\x01\x02\xff\xfe\r\n\r\n", {400}),
    ("request line only", b"GET\r\n\r\n", {400}),
    ("no version", b"GET /v1/models\r\n\r\n", {400}),
    ("HTTP/9.9", b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n", {200, 400, 505}),
    ("no Host", b"GET /v1/models HTTP/1.1\r\n\r\n", {400}),
    ("two Hosts", b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", {400}),
    ("NUL in path", b"GET /v1/mo\x00dels HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    ("UTF-8 in path", "GET /v1/modèls HTTP/1.1\r\nHost: x\r\n\r\n".encode(), {400}),
    ("space in header name", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", {400}),
    ("folded header", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n", {200, 400}),
    ("Content-Length 1e30", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1e30\r\n\r\n", {400}),
    ("Content-Length -1", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", {400}),
    ("Content-Length abc", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", {400}),
    (
        "Content-Length 31 digits",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 31 + b"\r\n\r\n",
        {400},
    ),
    (
        "two lengths",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        {400},
    ),
    ("gzip coding", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", {501}),
    (
        "bad chunk size",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        {400},
    ),
    # A head that arrives whole in one read is parsed; one that does not fit the parser's buffer is refused.
    ("40 kB header", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n", {200, 431}),
    ("40 kB URI", b"GET /" + b"a" * 40_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", {404, 431}),
    ("1 MB header", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n", {431}),
    ("DELETE", b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    ("PUT chat", b"PUT /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", {405}),
    ("BREW", b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", {404, 405}),
    ("traversal", b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", {404}),
    ("absolute URI", b"GET http://evil/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", {200, 400, 404}),
    (
        "websocket upgrade",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        {200, 400},
    ),
    ("no length POST", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", {411}),
    ("length over limit", post(CHAT, b"{}", length=10**15), {413}),
    ("body over limit", post(CHAT, b"[" * 70_000), {413}),
    ("10,001 messages", _body({**GOOD, "messages": [{"role": "user", "content": "x"}] * 10_001}), {413}),
    ("not JSON", post(CHAT, b"{model: tiny"), {400}),
    ("not UTF-8", post(CHAT, b'{"model": "\xff\xfe"}'), {400}),
    ("NaN", post(CHAT, b'{"model": "tiny", "temperature": NaN}'), {400}),
    ("deep nesting", post(CHAT, b"[" * 5000 + b"]" * 5000), {400}),
    ("unknown model", _body({**GOOD, "model": "gpt-4"}), {404}),
    ("max_tokens over limit", _body({**GOOD, "max_tokens": 10**9}), {400}),
    ("top_k -2", _body({**GOOD, "top_k": -2}), {400}),
    ("n 5", _body({**GOOD, "n": 5}), {400}),
    ("image part", _body({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), {400}),
]


@pytest.fixture(scope="module")
def hostile():
    engine = FakeEngine(FakePair("tiny"), reply=LONG_REPLY, step_delay_s=0.02)
    limits = Limits(max_body_bytes=64 << 10, max_tokens=256)
    with running_server(engine, limits=limits, queue_size=32, guard=GUARD, body_timeout_s=1.0) as (server, url):
        yield server, server.server_address[1]


def _json_error(answer: Answer, statuses: set[int], what: str) -> None:
    assert answer.status in statuses, f"{what}: {answer.raw[:300]!r}"
    if answer.status is not None and answer.status >= 400:
        error = answer.json()["error"]
        assert error["message"] and error["code"] == answer.status, what
        assert "Traceback" not in error["message"]


@pytest.mark.parametrize(("what", "data", "statuses"), BAD_HEADS, ids=[b[0] for b in BAD_HEADS])
@pytest.mark.parametrize("half_close", [False, True], ids=["open", "half-closed"])
def test_a_bad_request_gets_a_json_answer_at_once(hostile, what, data, statuses, half_close) -> None:
    _, port = hostile
    answer = exchange(port, data, half_close=half_close, timeout=10)
    FUZZED["serve: bad requests (raw socket)"] += 1
    _json_error(answer, statuses, what)
    assert answer.seconds < 3.0, f"{what} took {answer.seconds:.1f} s"


def test_random_bytes_never_crash_the_server(hostile) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _, port = hostile
    prefixes = st.sampled_from([b"", b"GET / HTTP/1.1\r\nHost: x\r\n", b"POST /v1/chat/completions HTTP/1.1\r\n"])

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(prefixes, st.binary(max_size=300))
    def run(prefix: bytes, noise: bytes) -> None:
        FUZZED["serve: bad requests (raw socket)"] += 1
        answer = exchange(port, prefix + noise + b"\r\n\r\n", half_close=True, timeout=5)
        if answer.status is not None:  # some noise is a valid request; the rest is refused
            assert answer.status < 500, answer.raw[:300]
            if answer.status >= 400:
                assert answer.json()["error"]["message"]

    run()
    assert exchange(port, _good(), half_close=True).status == 200  # still serving


def test_twenty_slow_half_closed_and_reset_clients(hostile) -> None:
    server, port = hostile
    results: dict[str, list] = {"slow head": [], "slow body": [], "half-closed": [], "reset": [], "not reading": []}
    before = server.metrics.snapshot()["requests"].get("cancelled", 0)

    def slow_head() -> None:
        with connect(port) as sock:
            for byte in b"GET /v1/models HTTP/1.1\r\nHost: x\r\n":  # a byte per 0.1 s: 3.5 s, over the 1 s limit
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.1)
            raw, _ = read_all(sock, 5)
        results["slow head"].append(Answer(raw, 0))

    def slow_body() -> None:
        with connect(port) as sock:
            sock.sendall(post(CHAT, b'{"model": "ti', length=200))
            raw, _ = read_all(sock, 5)
        results["slow body"].append(Answer(raw, 0))

    def half_closed() -> None:
        results["half-closed"].append(exchange(port, _good(), half_close=True, timeout=30))

    def resetting() -> None:
        sock = connect(port)
        sock.sendall(_body({**GOOD, "max_tokens": 200, "stream": True}))
        time.sleep(0.3)
        reset(sock)
        results["reset"].append(None)

    def not_reading() -> None:
        sock = connect(port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(_body({**GOOD, "max_tokens": 256, "stream": True}))
        time.sleep(2.5)  # never reads; the server's writes stall
        sock.close()
        results["not reading"].append(None)

    kinds = [slow_head] * 5 + [slow_body] * 4 + [half_closed] * 5 + [resetting] * 4 + [not_reading] * 2
    threads = [threading.Thread(target=kind) for kind in kinds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    FUZZED["serve: slow / half-closed / reset clients"] += len(kinds)
    assert all(a.status == 408 and "did not arrive" in a.json()["error"]["message"] for a in results["slow head"])
    assert all(a.status == 408 and "body" in a.json()["error"]["message"] for a in results["slow body"])
    for answer in results["half-closed"]:  # the reply, whole, to a client that shut its sending side
        assert answer.status == 200 and answer.json()["choices"][0]["message"]["content"].startswith("word")
    deadline = time.monotonic() + 20
    while (server.owner.running or server.owner.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.owner.running == 0 and server.owner.waiting == 0  # the reset clients' work was cancelled
    assert server.metrics.snapshot()["requests"].get("cancelled", 0) - before >= 4
    assert exchange(port, _good(), half_close=True).status == 200


def test_fifty_idle_clients_make_no_thread_and_the_server_answers_meanwhile(hostile) -> None:
    _, port = hostile
    before = thread_count()
    socks = [connect(port) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(b"GET /v1/mod")  # half a request head, then nothing
        time.sleep(0.3)
        during = thread_count()
        start = time.monotonic()
        answer = exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", half_close=True)
        assert answer.status == 200 and time.monotonic() - start < 2
    finally:
        for sock in socks:
            sock.close()
    READINGS["serve: threads with 50 idle clients"] = f"{during} (before: {before})"
    assert during <= before + 1


def test_connections_over_the_limit_get_503_json_and_the_rest_are_served() -> None:
    engine = FakeEngine(FakePair("tiny"), reply="ok")
    with running_server(engine, guard=Guard(max_connections=5, head_timeout_s=5.0)) as (server, _):
        port = server.server_address[1]
        socks = [connect(port) for _ in range(5)]
        try:
            time.sleep(0.2)
            refused = exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert refused.status == 503 and "limit" in refused.json()["error"]["message"]
        finally:
            for sock in socks:
                sock.close()
        time.sleep(0.3)
        assert exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", half_close=True).status == 200


def test_a_client_that_leaves_stops_its_generation(hostile) -> None:
    server, port = hostile
    for close in ("fin", "reset"):
        before = server.metrics.snapshot()["requests"].get("cancelled", 0)
        sock = connect(port)
        sock.sendall(_body({**GOOD, "max_tokens": 256}))  # not streamed: nothing is written until the end
        time.sleep(0.5)
        assert server.owner.running == 1
        sock.close() if close == "fin" else reset(sock)
        deadline = time.monotonic() + 5
        while server.owner.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.owner.running == 0, close  # 256 steps of 0.02 s would take 5 s
        assert server.metrics.snapshot()["requests"].get("cancelled", 0) == before + 1


def test_no_traceback_and_every_request_logged(hostile, caplog) -> None:
    _, port = hostile
    with caplog.at_level(logging.INFO):
        exchange(port, b"GET\r\n\r\n")
        exchange(port, _good(), half_close=True)
        sock = connect(port)
        sock.sendall(_body({**GOOD, "max_tokens": 100}))
        time.sleep(0.2)
        reset(sock)
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    lines = [r.getMessage() for r in caplog.records if r.name == "specchat.serve.access"]
    assert any('"- -" 400 invalid' in line for line in lines)
    assert any('"POST /v1/chat/completions" 200 ok tokens=' in line for line in lines)
    assert any('"POST /v1/chat/completions" 499 client-left' in line for line in lines)
    assert not any("hi" in line.split('"')[-1] for line in lines)  # no prompt text without --log-prompts


def test_prompts_are_logged_only_when_asked_and_escaped(caplog) -> None:
    engine = FakeEngine(FakePair("tiny"), reply="ok")
    body = {**GOOD, "messages": [{"role": "user", "content": 'secret "plan"\n\x1b[2J next'}]}
    for log_prompts in (False, True):
        with running_server(engine, log_prompts=log_prompts) as (server, _), caplog.at_level(logging.INFO):
            caplog.clear()
            assert exchange(server.server_address[1], _body(body), half_close=True).status == 200
            deadline = time.monotonic() + 5  # the line is written once the answer has gone out
            while not (lines := [r.getMessage() for r in caplog.records if r.name == "specchat.serve.access"]):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            (line,) = lines
        assert "\n" not in line and "\x1b" not in line
        assert ("secret" in line) == log_prompts
        if log_prompts:
            assert 'prompt="secret \\"plan\\"\\n\\u001b[2J next"' in line
