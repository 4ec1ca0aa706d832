"""`specchat serve` over real HTTP on 127.0.0.1 (app/serve/): the routes, the input boundary's errors, the API
key, the queue under 20 concurrent clients (every request answered or refused with 503, none lost, the engine's
blocks back to zero), the speculation fields other servers' clients read, and /metrics' per-position counts
(each reply's own step counts)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_fixtures import tiny_engine
from serve_fixtures import SlowEngine, running_server

from specchat.app.serve.boundary import Limits
from specchat.app.serve.owner import Metrics
from specchat.backend.api import RequestStats
from specchat.backend.remote.stats import from_llama_server, from_vllm

BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "w7 w8 w9 w7 w8 w9 w7 w8"}],
    "max_tokens": 12,
    "temperature": 0,
}


def _post(url: str, body: object, **kwargs) -> httpx.Response:
    return httpx.post(url + "/chat/completions", json=body, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    with running_server(engine, limits=Limits(max_body_bytes=4096, max_tokens=64)) as (server, url):
        yield engine, server, url


def test_models_metrics_health_and_unknown_routes(served) -> None:
    _, _, url = served
    models = httpx.get(url + "/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(url.removesuffix("/v1") + "/health").json()["status"] == "ok"
    metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    assert 'specchat_requests_total{outcome="ok"}' in metrics and "specchat_kv_blocks_in_use 0" in metrics
    missing = httpx.get(url + "/nothing")
    assert missing.status_code == 404 and "/v1/models" in missing.json()["error"]["message"]


def test_a_non_streaming_reply_carries_usage_timings_and_vllm_metrics(served) -> None:
    _, _, url = served
    response = _post(url, BODY)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"
    stats = body["specchat"]["stats"]
    assert body["timings"]["predicted_n"] == 12 and body["timings"]["prompt_n"] == stats["prefill_tokens"]
    if stats["drafted"]:  # the same numbers under llama-server's and vLLM's names
        assert from_llama_server(body)["drafted"] == stats["drafted"]
        assert from_vllm(body)["accepted"] == stats["accepted"]


def test_a_stream_is_server_sent_events_ending_with_usage_and_done(served) -> None:
    _, _, url = served
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"] == "text/event-stream"
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 12
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all("stats" in c["specchat"] for c in chunks)  # live statistics on every chunk


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "field 'body'"),
        ({"messages": BODY["messages"]}, 400, "field 'model'"),
        ({**BODY, "model": "gpt-4"}, 404, "models: tiny"),
        ({**BODY, "messages": []}, 400, "field 'messages'"),
        ({**BODY, "messages": [{"role": "robot", "content": "x"}]}, 400, "field 'messages[0].role'"),
        ({**BODY, "messages": [{"role": "user", "content": 5}]}, 400, "field 'messages[0].content'"),
        ({**BODY, "max_tokens": 65}, 400, "field 'max_tokens'"),
        ({**BODY, "temperature": -1}, 400, "field 'temperature'"),
        ({**BODY, "top_p": "high"}, 400, "field 'top_p'"),
        ({**BODY, "n": 3}, 400, "field 'n'"),
        ({**BODY, "stream": "yes"}, 400, "field 'stream'"),
        ({**BODY, "stop": [1]}, 400, "field 'stop'"),
        ({**BODY, "specchat": {"gamma": 99}}, 400, "field 'specchat.gamma'"),
        ({**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}, 413, "at most 4096"),
    ],
)
def test_the_input_boundary_answers_json_naming_the_field(served, body, status, named) -> None:
    _, _, url = served
    if isinstance(body, bytes):
        response = httpx.post(url + "/chat/completions", content=body, timeout=30)
    else:
        response = _post(url, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert named in error["message"] and error["code"] == status


def test_the_api_key() -> None:
    with running_server(tiny_engine(), api_key="k3y") as (_, url):
        assert httpx.get(url + "/models").status_code == 401
        assert httpx.get(url + "/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = httpx.get(url + "/models", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200
        assert _post(url, BODY, headers={"Authorization": "Bearer nope"}).json()["error"]["param"] == "Authorization"


def test_twenty_concurrent_clients_are_answered_or_refused_and_none_is_lost() -> None:
    engine = tiny_engine()
    with running_server(SlowEngine(engine, step_s=0.01), queue_size=4) as (server, url):
        start = threading.Barrier(20)

        def client(i: int) -> tuple[int, dict]:
            start.wait()
            body = {**BODY, "max_tokens": 8, "stream": i % 2 == 0, "stream_options": {"include_usage": True}}
            if body["stream"]:
                with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as response:
                    if response.status_code != 200:
                        response.read()
                        return response.status_code, response.json()
                    lines = [line for line in response.iter_lines() if line.startswith("data: {")]
                    return 200, json.loads(lines[-1][6:])
            response = _post(url, body)
            return response.status_code, response.json()

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(client, range(20)))
        codes = [code for code, _ in results]
        assert set(codes) <= {200, 503} and len(codes) == 20
        assert codes.count(503) >= 1 and codes.count(200) >= 5  # 1 running + 4 waiting at least
        for code, body in results:
            if code == 200:
                assert body["usage"]["completion_tokens"] == 8
            else:
                assert "busy" in body["error"]["message"] and "retry" in body["error"]["message"]
        # A reply is counted once its last byte is written: the client may read it a moment before.
        deadline = time.monotonic() + 10
        while (requests := server.metrics.snapshot()["requests"]).get("ok", 0) < codes.count(200):
            assert time.monotonic() < deadline, requests
            time.sleep(0.01)
        assert requests.get("ok", 0) == codes.count(200) and requests.get("rejected", 0) == codes.count(503)
        assert server.owner.running == 0 and server.owner.waiting == 0
    assert engine.blocks_in_use() == 0


def test_http_servers_own_refusals_are_json_too(served) -> None:
    _, _, url = served
    response = httpx.request("DELETE", url + "/models")
    assert response.status_code == 501 and "error" in response.json()
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        chunks = []  # the headers and the body may come in separate packets: read until the server closes
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        answer = b"".join(chunks).decode()
    assert answer.startswith("HTTP/1.1 400") and '"error"' in answer and "<html" not in answer.lower()
    no_length = httpx.post(url + "/chat/completions", content=iter([b"{}"]))  # streamed: chunked, no length
    assert no_length.status_code == 411 and no_length.json()["error"]["param"] == "Content-Length"


def test_metrics_add_up_each_replys_own_step_counts_when_it_ends() -> None:
    """/metrics' per-position counters are the replies' RequestStats step counts added up (every drafter's rows),
    the counts their own per_position_acceptance comes from: a tree step counts the positions it judged."""
    metrics = Metrics()
    tree_and_chain = {
        "reached": {"suffix": [3, 2, 1, 0], "prompt-lookup": [1]},
        "accepted_at": {"suffix": [2, 1, 0, 0], "prompt-lookup": [0]},
    }
    metrics.finished(RequestStats(step_counts=tree_and_chain), "ok")
    metrics.finished(RequestStats(), "ok")  # an engine that cannot know them (a remote server's reply)
    metrics.finished(None, "error")
    snap = metrics.snapshot()
    assert snap["reached_per_position"] == {0: 4, 1: 2, 2: 1} and snap["accepted_per_position"] == {0: 2, 1: 1}
    assert snap["requests"] == {"ok": 2, "error": 1}


def test_metrics_show_the_served_replys_step_counts() -> None:
    engine = tiny_engine(drafter="suffix")
    with running_server(engine) as (server, url):
        body = _post(url, {**BODY, "max_tokens": 40, "specchat": {"drafter": "suffix", "gamma": 4}}).json()
        deadline = time.monotonic() + 10  # a reply is counted once its last byte is written
        while server.metrics.snapshot()["requests"].get("ok", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    counts = body["specchat"]["stats"]["step_counts"]
    assert counts["reached"]["suffix"], "the reply drafted nothing: the test would compare nothing"
    for metric, key in (("num_reached_per_pos", "reached"), ("num_accepted_tokens_per_pos", "accepted_at")):
        shown = {
            int(line.split('"')[1]): int(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(f"specchat_spec_decode_{metric}_total{{")
        }
        rows = list(counts[key].values())
        expected = {j: sum(row[j] for row in rows if j < len(row)) for j in range(max(map(len, rows), default=0))}
        assert shown == {j: n for j, n in expected.items() if n}, (metric, text)
