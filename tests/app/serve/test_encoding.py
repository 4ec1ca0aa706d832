"""`specchat serve` answers every request in OpenAI's JSON error shape whatever the encoding of what it echoes
(issue 47, class 1): JSON's ``"\\ud800"`` decodes to a lone surrogate, which has no UTF-8 form, and a field that
holds one (``model``, a role, ``stop`` ...) must still get a JSON 400 / 404, never a plain-text 500."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import FakeEngine, FakePair
from serve_fixtures import running_server

from specchat.app.serve import wire

HI = [{"role": "user", "content": "hi"}]
BODIES: list[tuple[dict, int]] = [  # json.dumps writes each lone surrogate as its "\\udXXX" escape
    ({"model": "\ud800", "messages": HI}, 404),
    ({"model": "\udfff\x1b[31m", "messages": HI}, 404),
    ({"model": ["\ud800"], "messages": HI}, 400),
    ({"model": "tiny", "messages": [{"role": "\ud800", "content": "hi"}]}, 400),
    ({"model": "tiny", "messages": HI, "specchat": {"drafter": "\ud800"}}, 400),
    ({"model": "tiny", "messages": HI, "tool_choice": "\udc80"}, 400),
    ({"model": "tiny", "messages": HI, "stop": ["\ud800", 1]}, 400),
]


@pytest.fixture(scope="module")
def url():
    with running_server(FakeEngine(FakePair("tiny"), reply="ok")) as (_, base):
        yield base


@pytest.mark.parametrize(("body", "status"), BODIES)
def test_a_lone_surrogate_anywhere_gets_a_json_error(url: str, body: dict, status: int) -> None:
    response = httpx.post(url + "/chat/completions", content=json.dumps(body).encode(), timeout=10)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = json.loads(response.content.decode("utf-8"))["error"]  # strict UTF-8: the bytes are valid
    assert error["code"] == status and error["type"] and error["message"]


def test_the_encoder_writes_a_lone_surrogate_back_as_its_json_escape() -> None:
    payload = {"error": {"message": "model '\ud800\\' is not served", "param": "\udfff"}}
    data = wire.encode(payload)
    assert json.loads(data.decode("utf-8")) == payload
    assert wire.sse(payload).decode("utf-8").startswith("data: {")


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 1e-320), ("temperature", 1e-320), ("top_k", 2**70), ("top_p", 5e-324)],
)
def test_values_that_mean_nothing_are_a_400_naming_the_field(url: str, field: str, value: object) -> None:
    """Issue 47, class 8: the ranges of backend/limits.py, refused at the server's boundary."""
    body = {"model": "tiny", "messages": HI, field: value}
    response = httpx.post(url + "/chat/completions", content=json.dumps(body).encode(), timeout=10)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and f"field '{field}'" in error["message"]
