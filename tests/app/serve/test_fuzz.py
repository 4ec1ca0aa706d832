"""Fuzzing `specchat serve`'s input boundary (app/serve/boundary.py): any request body, valid or not, gets either
a reply or a JSON error whose message names the bad thing; never a traceback, never a 500. In process (a few
hundred bodies) and over real HTTP on 127.0.0.1 (a fake engine answers, so the bodies that pass cost nothing)."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import FakeEngine, FakePair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_fixtures import running_server

from specchat.app.serve.boundary import ApiError, Limits, parse_chat_request

SERVED = ("tiny",)
LIMITS = Limits(max_body_bytes=1 << 16, max_tokens=32)
KEYS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "tools",
    "logprobs",
    "response_format",
    "presence_penalty",
    "specchat",
    "repetition_penalty",
    "return_token_ids",
    "user",
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "assistant", "system", "tool", ""]) | json_values,
            "content": st.text(max_size=40)
            | json_values
            | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=9)})
            ),
        },
    ),
    max_size=4,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "gpt-4", ""]) | json_values,
        "messages": messages | json_values,
        **{key: json_values | st.integers(-3, 40) for key in KEYS[2:]},
    },
)
raw = (
    st.binary(max_size=200)
    | bodies.map(lambda b: json.dumps(b).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
)


def _check_error(error: ApiError) -> None:
    assert error.status in (400, 404)
    assert error.message and (
        "field '" in error.message or "request body" in error.message or "not served here" in error.message
    ), error.message
    json.dumps(error.body())  # answerable as JSON


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw)
def test_any_body_is_a_checked_call_or_an_error_naming_the_field(body: bytes) -> None:
    try:
        call = parse_chat_request(body, SERVED, LIMITS)
    except ApiError as error:
        _check_error(error)
    else:
        assert call.model == "tiny" and call.request.messages
        assert call.request.sampling.max_new_tokens is None or call.request.sampling.max_new_tokens <= 32


@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine(FakePair("tiny"), reply="ok then")
    with running_server(engine, limits=LIMITS) as (server, url):
        yield url


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(raw)
def test_over_http_every_body_gets_json(fake_server: str, body: bytes) -> None:
    response = httpx.post(
        fake_server + "/chat/completions", content=body, timeout=30, headers={"Content-Type": "application/json"}
    )
    assert response.status_code in (200, 400, 404), response.text
    if response.headers["content-type"] == "text/event-stream":
        assert response.text.rstrip().endswith("data: [DONE]")
        return
    payload = response.json()
    if response.status_code != 200:
        assert (
            "field '" in payload["error"]["message"]
            or "request body" in payload["error"]["message"]
            or "not served here" in payload["error"]["message"]
        )
    else:
        assert payload["object"] == "chat.completion"
