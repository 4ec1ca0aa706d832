"""A remote request's two deadlines (issue 47, class 3): no new token for the pair's ``no_progress_s`` (keep-alive
comments and empty chunks do not count), or not finished within its ``deadline_s``. Each stall below ran past
75 s before (httpx's read timeout restarts with every byte); each now ends within its deadline, with an error
naming the server and the models.yaml field to change."""

from __future__ import annotations

import time

import pytest
from faulty_server import SSE, STALLS, Conn, chunk, faulty_server, response, sse, timed_reply
from serve_fixtures import remote_pair

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.errors import ConfigError, RemoteError
from specchat.backend.remote.client import RemoteEngine

NO_PROGRESS_S, DEADLINE_S = 0.6, 2.0


@pytest.fixture(scope="module")
def faulty():
    with faulty_server() as server:
        yield server


@pytest.mark.parametrize("name", list(STALLS))
def test_every_stall_ends_within_its_deadline_naming_the_server(faulty, tmp_path, name) -> None:
    behaviour, which, token_first = STALLS[name]
    faulty.behaviour = behaviour
    url = f"http://127.0.0.1:{faulty.port}/v1"
    pair = remote_pair(tmp_path, url, kind="vllm", no_progress_s=NO_PROGRESS_S, deadline_s=DEADLINE_S)
    request = GenerationRequest(
        messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_new_tokens=10_000)
    )
    events, error, took = timed_reply(RemoteEngine(pair), request)
    limit = NO_PROGRESS_S if which == "no_progress" else DEADLINE_S
    assert took < limit + 1.0, (name, took)
    message = error or (events[-1].message or "")
    assert url in message and f"target.{which}_s of pair 'remote'" in message, message
    if token_first:
        assert events and events[-1].finish_reason == "error" and "partial reply is kept" in message
        assert "".join(e.text for e in events)
    else:
        assert error or not "".join(e.text for e in events), message


def test_a_slow_server_that_keeps_sending_tokens_is_not_cut(faulty, tmp_path) -> None:
    def slow(conn: Conn) -> None:
        conn.send(response(200, b"", SSE))
        for _ in range(6):
            time.sleep(0.3)
            conn.send(sse(chunk("w", ids=[1])))
        conn.send(sse(chunk("", finish="stop"), b"[DONE]"))

    faulty.behaviour = slow
    pair = remote_pair(tmp_path, f"http://127.0.0.1:{faulty.port}/v1", kind="vllm", no_progress_s=NO_PROGRESS_S)
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"}])
    events = list(RemoteEngine(pair).generate(request))
    assert events[-1].finish_reason == "eos" and "".join(e.text for e in events) == "w" * 6


@pytest.mark.parametrize("value", ["0", "-1", ".nan", "1e9", "true", "soon"])
def test_a_bad_deadline_in_models_yaml_is_refused_naming_the_field(tmp_path, value) -> None:
    with pytest.raises(ConfigError, match=r"field 'target.deadline_s'"):
        remote_pair(tmp_path, "http://127.0.0.1:1/v1", deadline_s=value)


def test_a_keep_alive_comment_every_second_does_not_count_as_progress(faulty, tmp_path) -> None:
    """The issue's case as it was seen: a comment each second, which restarted httpx's read timeout forever."""

    def comments(conn: Conn) -> None:
        if conn.send(response(200, b"", SSE)):
            end = time.monotonic() + 15
            while time.monotonic() < end and conn.send(b": keep-alive\n\n"):
                time.sleep(1.0)

    faulty.behaviour = comments
    url = f"http://127.0.0.1:{faulty.port}/v1"
    pair = remote_pair(tmp_path, url, kind="vllm", no_progress_s=2.5, deadline_s=60)
    start = time.monotonic()
    with pytest.raises(RemoteError, match=r"sent no new token for 2.5 s \(target.no_progress_s of pair 'remote'"):
        list(RemoteEngine(pair).generate(GenerationRequest(messages=[{"role": "user", "content": "hi"}])))
    assert time.monotonic() - start < 4.0
