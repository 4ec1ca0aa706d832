"""`specchat serve` takes OpenAI's ``prediction`` (issue 35): the reply is the one without it, drafted from the
predicted text, with ``usage.completion_tokens_details``' two counts; a prediction it cannot honour is a 400
naming the field."""

from __future__ import annotations

import httpx
import pytest
from engine_fixtures import tiny_engine
from serve_fixtures import running_server

from specchat.app.serve.boundary import Limits

BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "w7 w8 w9 w7 w8 w9 w7 w8"}],
    "max_tokens": 24,
    "temperature": 0,
}


def _post(url: str, body: object) -> httpx.Response:
    return httpx.post(url + "/chat/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def served():
    with running_server(tiny_engine(), limits=Limits(max_body_bytes=65536, max_tokens=64)) as (_, url):
        yield url


def test_a_prediction_drafts_the_same_reply_and_reports_its_counts(served) -> None:
    plain = _post(served, BODY).json()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]  # no prediction, no counts
    for prediction in (
        {"type": "content", "content": text},
        {"type": "content", "content": [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]},
        {"type": "content", "content": "something else entirely " * 3},
    ):
        answer = _post(served, {**BODY, "prediction": prediction}).json()
        assert answer["choices"][0]["message"]["content"] == text  # lossless
        details = answer["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= 0 and details["rejected_prediction_tokens"] >= 0
    exact = _post(served, {**BODY, "prediction": {"type": "content", "content": text}}).json()
    assert exact["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


def test_a_stream_with_a_prediction_ends_with_the_counts(served) -> None:
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}, "prediction": {"type": "content",
            "content": "w7 w8 w9"}}  # fmt: skip
    with httpx.stream("POST", served + "/chat/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert '"completion_tokens_details"' in lines[-1]


@pytest.mark.parametrize(
    ("prediction", "named"),
    [
        ("just text", "prediction"),
        ({"type": "text", "content": "x"}, "prediction"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "prediction.content"),
        ({"type": "content", "content": 7}, "prediction.content"),
        ({"type": "content", "content": "x", "extra": 1}, "prediction"),
    ],
)
def test_a_prediction_it_cannot_honour_is_a_400_naming_the_field(served, prediction, named) -> None:
    response = _post(served, {**BODY, "prediction": prediction})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == named and f"field '{named}'" in error["message"]
