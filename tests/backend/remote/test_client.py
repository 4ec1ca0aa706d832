"""The remote engine (backend/remote/client.py) against a real `specchat serve` started here on 127.0.0.1: the
reply, its statistics, cancellation, a server that dies mid-reply, a wrong API key, an unreachable host, a slow
first token. Only loopback is addressed."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from engine_fixtures import tiny_engine
from serve_fixtures import SlowEngine, closed_port, remote_pair, running_server, server_process

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.errors import RemoteError, RequestError
from specchat.backend.remote.client import RemoteEngine, check_server

PROMPT = [{"role": "user", "content": "w7 w8 w9 w10 w7 w8 w9 w10 w7 w8 w9"}]


def _request(max_new_tokens: int = 24, **kwargs) -> GenerationRequest:
    return GenerationRequest(
        messages=PROMPT, sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens), **kwargs
    )


def test_a_reply_through_the_server_equals_the_local_engine_with_the_servers_statistics(tmp_path: Path) -> None:
    engine = tiny_engine()
    local = list(engine.generate(_request()))
    with running_server(engine) as (_, url):
        remote = RemoteEngine(remote_pair(tmp_path, url))
        events = list(remote.generate(_request()))
        remote.close()
    assert [t for e in events for t in e.token_ids] == [t for e in local for t in e.token_ids]
    assert "".join(e.text for e in events) == "".join(e.text for e in local)
    # the sources are the server's (its γ policy learned from the first request, so they may differ from it)
    assert all(len(e.sources) == len(e.token_ids) == len(e.token_texts) for e in events)
    assert all("".join(e.token_texts) == e.text for e in events)
    last = events[-1]
    assert last.finish_reason == local[-1].finish_reason == "length"
    stats = last.stats
    assert stats is not None and stats.new_tokens == 24 and stats.drafter == "prompt-lookup"
    assert stats.drafted is not None and stats.steps is not None and stats.prefill_tokens is not None
    assert stats.ttft_s is not None and 0 < stats.ttft_s <= stats.wall_s and stats.tok_s is not None
    assert events[0].is_prefill and events[0].stats is not None and events[0].stats.new_tokens >= 1  # live
    assert engine.blocks_in_use() == 0


def test_an_openai_kind_pair_reads_the_same_servers_speculation_from_its_standard_fields(tmp_path: Path) -> None:
    with running_server(tiny_engine()) as (_, url):
        remote = RemoteEngine(remote_pair(tmp_path, url, kind=None))  # kind openai: no extension asked for
        events = list(remote.generate(_request()))
    assert all(e.token_ids == [] for e in events)  # token ids were not asked for
    stats = events[-1].stats
    assert stats is not None and stats.new_tokens == 24  # from usage
    assert stats.drafted is not None  # the specchat block rides on every chunk anyway


def test_cancel_mid_stream_closes_the_stream_and_the_server_stops(tmp_path: Path) -> None:
    engine = tiny_engine()
    with running_server(SlowEngine(engine, step_s=0.1)) as (server, url):
        remote = RemoteEngine(remote_pair(tmp_path, url))
        cancel = threading.Event()
        events = []
        for event in remote.generate(_request(max_new_tokens=200), cancel):
            events.append(event)
            if len(events) == 3:
                cancel.set()
        assert events[-1].finish_reason == "cancelled"
        assert len(events) <= 5 and "".join(e.text for e in events[:3])
        deadline = time.monotonic() + 10
        while (
            server.owner.running or server.metrics.snapshot()["requests"].get("cancelled", 0) < 1
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.owner.running == 0 and server.metrics.snapshot()["requests"]["cancelled"] == 1
    assert engine.blocks_in_use() == 0


def test_cancel_while_the_first_token_is_awaited_returns_at_once(tmp_path: Path) -> None:
    with running_server(SlowEngine(tiny_engine(), first_s=1.5)) as (_, url):
        remote = RemoteEngine(remote_pair(tmp_path, url))
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        started = time.monotonic()
        events = list(remote.generate(_request(), cancel))
        assert time.monotonic() - started < 1.3 or events[-1].finish_reason == "cancelled"
        assert events[-1].finish_reason == "cancelled"


def test_a_slow_first_token_is_waited_for_and_measured(tmp_path: Path) -> None:
    with running_server(SlowEngine(tiny_engine(), first_s=1.0)) as (_, url):
        events = list(RemoteEngine(remote_pair(tmp_path, url)).generate(_request(max_new_tokens=8)))
    stats = events[-1].stats
    assert events[-1].finish_reason == "length" and stats is not None
    assert stats.ttft_s is not None and stats.ttft_s >= 1.0


def test_a_server_that_never_answers_within_the_read_timeout_is_a_clear_error(tmp_path: Path) -> None:
    with running_server(SlowEngine(tiny_engine(), first_s=3.0)) as (_, url):
        remote = RemoteEngine(remote_pair(tmp_path, url, no_progress_s=0.5))
        with pytest.raises(RemoteError, match=r"sent no new token for 0.5 s \(target.no_progress_s of pair 'remote'"):
            list(remote.generate(_request()))


def test_a_server_that_dies_mid_reply_ends_it_with_an_error_and_keeps_the_partial_text(tmp_path: Path) -> None:
    with server_process(step_s=0.2) as (proc, url):
        remote = RemoteEngine(remote_pair(tmp_path, url))
        events = []
        for event in remote.generate(_request(max_new_tokens=100)):
            events.append(event)
            if len(events) == 3:
                proc.kill()
    last = events[-1]
    assert last.finish_reason == "error"
    assert last.message is not None and "partial reply is kept" in last.message and url in last.message
    assert "".join(e.text for e in events[:3]).strip()


def test_a_wrong_or_missing_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_server(tiny_engine(), api_key="s3cret") as (_, url):
        pair = remote_pair(tmp_path, url, api_key_env="SPECCHAT_TEST_KEY")
        monkeypatch.delenv("SPECCHAT_TEST_KEY", raising=False)
        with pytest.raises(RemoteError, match="SPECCHAT_TEST_KEY is not set"):
            RemoteEngine(pair)
        monkeypatch.setenv("SPECCHAT_TEST_KEY", "wrong")
        with pytest.raises(RemoteError, match="401.*API key refused.*SPECCHAT_TEST_KEY"):
            list(RemoteEngine(pair).generate(_request()))
        assert check_server(pair.remote, pair.name)["error"] is not None
        no_key = remote_pair(tmp_path, url, name="nokey")
        with pytest.raises(RemoteError, match="set api_key_env"):
            list(RemoteEngine(no_key).generate(_request()))
        monkeypatch.setenv("SPECCHAT_TEST_KEY", "s3cret")
        assert list(RemoteEngine(pair).generate(_request(max_new_tokens=4)))[-1].finish_reason == "length"


def test_an_unreachable_host_and_an_unknown_model(tmp_path: Path) -> None:
    pair = remote_pair(tmp_path, f"http://127.0.0.1:{closed_port()}/v1")
    with pytest.raises(RemoteError, match="cannot reach http://127.0.0.1"):
        list(RemoteEngine(pair).generate(_request()))
    assert check_server(pair.remote, pair.name)["reachable"] is False
    with running_server(tiny_engine(), model="tiny") as (_, url):
        other = remote_pair(tmp_path, url, model="llama-70b", name="other")
        with pytest.raises(RemoteError, match="404.*'llama-70b' is not served here; models: tiny"):
            list(RemoteEngine(other).generate(_request()))
        assert check_server(other.remote, other.name)["model_listed"] is False


def test_token_ids_are_refused_before_any_network_use(tmp_path: Path) -> None:
    pair = remote_pair(tmp_path, f"http://127.0.0.1:{closed_port()}/v1")
    with pytest.raises(RequestError, match="send messages"):
        RemoteEngine(pair).generate(GenerationRequest(prompt_ids=[1, 2, 3]))


def test_request_body_per_kind(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9/v1"
    request = GenerationRequest(
        messages=PROMPT, sampling=SamplingParams(temperature=0.0, top_k=5, seed=3), drafter="prompt-lookup", gamma=4
    )
    bodies = {
        kind: RemoteEngine(remote_pair(tmp_path, url, kind=kind, name=kind)).request_body(request)
        for kind in ("openai", "vllm", "sglang", "llama-server", "specchat")
    }
    assert bodies["openai"]["stream_options"] == {"include_usage": True} and "top_k" not in bodies["openai"]
    assert bodies["vllm"]["return_token_ids"] is True and bodies["vllm"]["top_k"] == 5
    assert bodies["sglang"]["return_spec_tokens_details"] is True
    assert bodies["llama-server"]["timings_per_token"] is True
    assert bodies["specchat"]["specchat"] == {"drafter": "prompt-lookup", "gamma": 4}
    assert all("specchat" not in b for k, b in bodies.items() if k != "specchat")
    sampled = remote_pair(tmp_path, url, name="defaults", extra="    sampling: {temperature: 0.3, max_new_tokens: 7}\n")
    body = RemoteEngine(sampled).request_body(GenerationRequest(messages=PROMPT))
    assert body["temperature"] == 0.3 and body["max_tokens"] == 7  # the pair's defaults


def test_a_prediction_goes_to_the_kinds_that_take_one_and_its_usage_counts_come_back(tmp_path: Path) -> None:
    """Issue 35: OpenAI's ``prediction`` field for kinds openai and specchat; the others get a notice instead. The
    counts in ``usage.completion_tokens_details`` are read for a request that sent one (OpenAI reports zeros for
    every request: without a prediction they stay None)."""
    from specchat.backend.remote.reply import ReplyState

    url = "http://127.0.0.1:9/v1"
    request = GenerationRequest(messages=PROMPT, prediction="def f():\n    return 1\n")
    for kind in ("openai", "vllm", "sglang", "llama-server", "specchat"):
        engine = RemoteEngine(remote_pair(tmp_path, url, kind=kind, name=kind))
        body, notice = engine.request_body(request), engine._notice(request)
        if kind in ("openai", "specchat"):
            assert body["prediction"] == {"type": "content", "content": request.prediction} and notice is None
        else:
            assert "prediction" not in body and f"a {kind} server, which takes no prediction" in notice
    assert "prediction" not in RemoteEngine(remote_pair(tmp_path, url, kind="openai")).request_body(_request())
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 12,
        "completion_tokens_details": {"accepted_prediction_tokens": 10, "rejected_prediction_tokens": 3},
    }
    final = json.dumps({"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}], "usage": usage})
    for predicted, expected in ((True, (10, 3)), (False, (None, None))):
        reply = ReplyState("p", url, time.perf_counter(), None, 100, predicted=predicted)
        stats = reply.chunk(final).stats
        assert (stats.accepted_prediction_tokens, stats.rejected_prediction_tokens) == expected
        assert stats.new_tokens == 12
