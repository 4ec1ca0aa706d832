"""Fuzzing the remote client against hostile servers on 127.0.0.1 (issue 47): every stall (headers with no body,
no answer, a stall after a chunk, a lying Content-Length, keep-alives, a trickled head, tokens past the deadline),
servers that echo the API key and the URL's password back, error pages and JSON errors of every status with
escapes in them, and random event streams (hostile text, comments, empty chunks, garbage, pauses). Each ends
within its deadline (the pair's no_progress_s and deadline_s, short here), as a one-line RemoteError or a reply
whose last event says what happened; nothing shown holds a secret or a control character; nothing else is
raised."""

from __future__ import annotations

import json
import re
import time

import pytest
from faulty_server import STALLS, Conn, chunk, faulty_server, response, sse, stream, timed_reply
from hypothesis import strategies as st
from reliability import FUZZED, READINGS, fuzz
from serve_fixtures import remote_pair

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.remote.client import RemoteEngine

KEY, PASSWORD, TOKEN = "sk-fuzz-7f3a9c1e5b", "pw-fuzz-2468", "tk-fuzz-1357"
NO_PROGRESS_S, DEADLINE_S = 0.5, 1.5
MARGIN_S = 1.5  # a reply ends by its deadline plus this (the watchdog's poll, a loaded machine)
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
SECRETS = (KEY, PASSWORD, TOKEN)
ESCAPES = "\x1b[31mred\x1b[0m \x1b]0;owned\x07 \x9b2J \r\x08"


def _auth(conn: Conn) -> str:
    head = conn.request.split(b"\r\n\r\n")[0].decode("latin-1")
    return next(
        (line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.lower().startswith("authorization")), ""
    )


def _echo(status: int, kind: str, template: str) -> object:
    def run(conn: Conn) -> None:
        body = template.replace("{auth}", _auth(conn)).replace("{pw}", PASSWORD).replace("{tok}", TOKEN)
        conn.send(response(status, body.encode(), {"Content-Type": kind}))

    return run


BEHAVIOURS: dict[str, object] = {f"stall: {name}": spec[0] for name, spec in STALLS.items()}
for _status in (200, 400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504):
    BEHAVIOURS[f"{_status} JSON echo"] = _echo(
        _status, "application/json", json.dumps({"error": {"message": "bad key {auth} " + ESCAPES}})
    )
    BEHAVIOURS[f"{_status} text echo"] = _echo(_status, "text/plain", "denied for {auth} at user:{pw} ?t={tok}")
    BEHAVIOURS[f"{_status} HTML"] = _echo(_status, "text/html", "<html>{auth}" + ESCAPES + "</html>")
    BEHAVIOURS[f"{_status} empty"] = lambda conn, s=_status: conn.send(response(s))
BEHAVIOURS["error chunk echo"] = lambda conn: stream(sse(chunk("a"), {"error": {"message": f"{KEY} {ESCAPES}"}}))(conn)
BEHAVIOURS["reply echoes the key"] = lambda conn: stream(sse(chunk(f"k={KEY} {ESCAPES}"), chunk("", finish="stop")))(
    conn
)


@st.composite
def streams(draw: st.DrawFn) -> object:
    """A server answering 200 with a random event stream: hostile text, comments, empty chunks, garbage lines,
    pauses, the key echoed, and maybe no finish or no [DONE]."""
    parts: list[tuple[bytes, float]] = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["text", "comment", "empty", "garbage", "key", "ids"]))
        text = draw(
            st.text(st.sampled_from(["a", " ", "\x1b", "[", "3", "1", "m", "\x07", "\x9b", "\r", "é"]), max_size=8)
        )
        data = {
            "text": sse(chunk(text)),
            "comment": b": keep-alive\n\n",
            "empty": sse({"choices": [{"delta": {}}]}),
            "garbage": b"data: {not json\n\n",
            "key": sse(chunk(f"{text}{KEY}")),
            "ids": sse(chunk(text, ids=[1, 2])),
        }[kind]
        parts.append((data, draw(st.sampled_from([0.0, 0.0, 0.05, 0.2, 0.7]))))
    if draw(st.booleans()):
        parts.append((sse(chunk("", finish="stop")), 0.0))
    if draw(st.booleans()):
        parts.append((b"data: [DONE]\n\n", 0.0))

    def run(conn: Conn) -> None:
        if not conn.send(response(200, b"", {"Content-Type": "text/event-stream", "Content-Length": None})):  # type: ignore[dict-item]
            return
        for data, pause in parts:
            time.sleep(pause)
            if not conn.send(data):
                return

    return run


@pytest.fixture(scope="module")
def faulty():
    with faulty_server() as server:
        yield server


def _shown(events: list, error: str) -> list[str]:
    shown = [error]
    for event in events:
        shown += [event.text, event.message or "", event.drafter, *event.token_texts]
        if event.stats is not None:
            shown += [v for v in event.stats.to_dict().values() if isinstance(v, str)]
    return shown


def test_hostile_servers_end_in_time_without_secrets_or_escapes(faulty, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FUZZ_REMOTE_KEY", KEY)
    url = f"'http://user:{PASSWORD}@127.0.0.1:{faulty.port}/v1?token={TOKEN}'"
    pair = remote_pair(
        tmp_path, url, kind="vllm", api_key_env="FUZZ_REMOTE_KEY", no_progress_s=NO_PROGRESS_S, deadline_s=DEADLINE_S
    )
    request = GenerationRequest(
        messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_new_tokens=64)
    )
    counts = {"behaviours": 0, "late": 0, "secrets": 0, "escapes": 0}

    def run(behaviour: object) -> None:
        faulty.behaviour = behaviour
        events, error, took = timed_reply(RemoteEngine(pair), request)
        counts["behaviours"] += 1
        counts["late"] += took > DEADLINE_S + MARGIN_S
        shown = _shown(events, error)
        counts["secrets"] += any(secret in text for text in shown for secret in SECRETS)
        counts["escapes"] += any(CONTROL.search(text.replace("\n", "").replace("\t", "")) for text in shown)
        assert took <= DEADLINE_S + MARGIN_S, took
        assert not any(secret in text for text in shown for secret in SECRETS), shown
        assert not any(CONTROL.search(text.replace("\n", "").replace("\t", "")) for text in shown), shown
        assert error or (events and events[-1].finish_reason is not None)
        assert "\n" not in error and "Traceback" not in error

    try:
        for behaviour in BEHAVIOURS.values():
            FUZZED["remote: hostile server behaviours"] += 1
            run(behaviour)
        fuzz("remote: hostile server behaviours", streams(), run, 60)
    finally:
        READINGS["remote hostile run: behaviours, past deadline, secrets shown, escapes shown"] = (
            f"{counts['behaviours']}, {counts['late']}, {counts['secrets']}, {counts['escapes']}"
        )
    assert counts["behaviours"] >= 50
