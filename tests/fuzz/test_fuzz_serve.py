"""Fuzzing `specchat serve` over real HTTP on 127.0.0.1 (issue 47): every string field of a chat request (``model``,
roles, contents, content parts, ``stop``, ``user``, ``prompt_cache_key``, ``specchat.drafter``, ``tool_choice``,
``response_format.type``, ``prediction.content``, keys) holds lone surrogates, control characters and terminal
escapes, and bodies arrive as invalid UTF-8 too. Every answer is a reply or a JSON error in OpenAI's shape whose
bytes are strict UTF-8; nothing is a 500, nothing logs a traceback, and no access-log line carries a control
character (what the operator's terminal shows). A fake engine answers, so the bodies that pass cost nothing."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
from fake_engine import FakeEngine, FakePair
from hypothesis import strategies as st
from reliability import READINGS, fuzz
from serve_fixtures import running_server

from specchat.app.serve.boundary import Limits

EXAMPLES = 520
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
HOSTILE = st.one_of(
    st.text(max_size=12),
    st.text(
        st.sampled_from(["\ud800", "\udfff", "\udc80", "\x00", "\x1b", "\x07", "\r", "\x9b", "\u202e", "a", "é"]),
        min_size=1,
        max_size=8,
    ),  # fmt: skip
    st.sampled_from(["\ud800", "tiny\udfff", "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "\x9b2J", "a\x00b", "\r\n"]),
)
STRING_FIELDS = ["model", "stop", "user", "prompt_cache_key", "tool_choice", "response_format", "prediction",
                 "specchat", "role", "content", "part", "key"]  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A request whose string fields (at least one) are hostile, as JSON with \\u escapes (lone surrogates
    included), or now and then as raw bytes that are not UTF-8."""
    hostile = set(draw(st.lists(st.sampled_from(STRING_FIELDS), min_size=1, max_size=4)))

    def text(field: str, fallback: str) -> str:
        return draw(HOSTILE) if field in hostile else fallback

    content: object = text("content", "hi")
    if "part" in hostile:
        content = [{"type": text("part", "text"), "text": draw(HOSTILE)}]
    body: dict[str, object] = {
        "model": text("model", "tiny"),
        "messages": [{"role": text("role", "user"), "content": content}],
        "max_tokens": 4,
        "stream": draw(st.booleans()),
    }
    if "stop" in hostile:
        body["stop"] = draw(st.one_of(HOSTILE, st.lists(HOSTILE, max_size=3)))
    for field in ("user", "prompt_cache_key", "tool_choice"):
        if field in hostile:
            body[field] = draw(HOSTILE)
    if "response_format" in hostile:
        body["response_format"] = {"type": draw(HOSTILE)}
    if "prediction" in hostile:
        body["prediction"] = {"type": "content", "content": draw(HOSTILE)}
    if "specchat" in hostile:
        body["specchat"] = {"drafter": draw(HOSTILE), "gamma": draw(st.sampled_from([1, "auto", "\ud800"]))}
    if "key" in hostile:
        body[draw(HOSTILE)] = draw(HOSTILE)
    data = json.dumps(body).encode()  # ensure_ascii: a lone surrogate is written as its \\u escape
    if draw(st.integers(0, 9)) == 0:  # a body that is not UTF-8 at all
        data = data.replace(b'"hi"', b'"h\xff\xfei"').replace(b'"tiny"', b'"t\xc3\x28"')
    return data


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.tracebacks = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.tracebacks += record.exc_info is not None or "Traceback" in record.getMessage()


@pytest.fixture(scope="module")
def served():
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("specchat.serve", "specchat.serve.access", "uvicorn.error")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
    try:
        with running_server(FakeEngine(FakePair("tiny"), reply="ok then"), limits=Limits(max_tokens=32)) as (_, url):
            yield url, records
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(records)
            logger.setLevel(level)


def test_every_hostile_string_gets_a_reply_or_a_json_error(served) -> None:
    url, records = served
    statuses: dict[int, int] = {}

    def check(body: bytes) -> None:
        response = httpx.post(url + "/chat/completions", content=body, timeout=30)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code in (200, 400, 404), (response.status_code, response.text[:300])
        text = response.content.decode("utf-8")  # strict: never a byte that is not UTF-8
        if response.headers["content-type"].startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]") or '"error"' in text, text[-300:]
            return
        payload = json.loads(text)
        if response.status_code != 200:
            error = payload["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
            assert isinstance(error["message"], str) and error["message"]

    fuzz("serve: hostile strings over HTTP", bodies(), check, EXAMPLES)
    escapes = [line for line in records.lines if CONTROL.search(line)]
    READINGS["serve hostile run: 500s, tracebacks, log lines with escapes"] = (
        f"{statuses.get(500, 0)}, {records.tracebacks}, {len(escapes)} (statuses {dict(sorted(statuses.items()))})"
    )
    assert records.tracebacks == 0, [line for line in records.lines if "Traceback" in line][:3]
    assert not escapes, escapes[:3]
    assert statuses.get(400, 0) + statuses.get(404, 0) > EXAMPLES // 4, statuses
