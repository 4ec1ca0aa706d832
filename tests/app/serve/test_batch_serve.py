"""`specchat serve --parallel N` (a BatchScheduler behind the owner): concurrent clients each get the reply the
request gets alone, /metrics shows the batch, a client that leaves frees its slot, and a request whose K/V does
not fit gets 503."""

from __future__ import annotations

import threading

import httpx
from batch_fixtures import native_engine, request, solo
from native_fixtures import native_ready  # noqa: F401  (a fixture)
from serve_fixtures import running_server

from specchat.backend.engine.batch import BatchScheduler


def _body(i: int, tokens: int = 12) -> dict:
    req = request(i, tokens=tokens)
    assert req.messages is not None
    return {"model": "tiny", "messages": req.messages, "max_tokens": tokens, "temperature": 0, "return_token_ids": True}


def test_concurrent_clients_get_their_solo_replies(native_ready, tmp_path):  # noqa: F811
    engine = native_engine(tmp_path, parallel=4)
    want = [solo(engine, request(i, tokens=12)) for i in range(6)]
    batch = BatchScheduler(engine, 4).start()
    got: dict[int, list[int]] = {}
    with running_server(engine, batch=batch) as (_, url):

        def client(i: int) -> None:
            reply = httpx.post(f"{url}/chat/completions", json=_body(i), timeout=60)
            assert reply.status_code == 200, reply.text
            got[i] = reply.json()["choices"][0]["token_ids"]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        metrics = httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=10).text
    assert [got[i] for i in range(6)] == want
    assert "specchat_batch_slots 4" in metrics
    assert "specchat_batch_passes_total" in metrics and "specchat_batch_rows_per_pass" in metrics
    assert engine.cache.pool.num_used == 0


def test_a_request_whose_context_does_not_fit_gets_503(native_ready, tmp_path, monkeypatch):  # noqa: F811
    engine = native_engine(tmp_path, parallel=2)
    monkeypatch.setattr("specchat.backend.engine.batch.free_memory", lambda device: 0)
    batch = BatchScheduler(engine, 2).start()
    with running_server(engine, batch=batch) as (_, url):
        reply = httpx.post(f"{url}/chat/completions", json=_body(1), timeout=60)
    assert reply.status_code == 503
    assert "KV cache" in reply.json()["error"]["message"]


def test_a_client_that_leaves_frees_its_slot_and_blocks(native_ready, tmp_path):  # noqa: F811
    import time

    engine = native_engine(tmp_path, parallel=2)
    batch = BatchScheduler(engine, 2).start()
    with running_server(engine, batch=batch) as (_, url):
        body = {**_body(1, tokens=400), "stream": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            assert any(line.startswith("data: ") for line in lines)  # it is streaming
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (batch.running or engine.cache.pool.num_used):
            time.sleep(0.05)
        assert batch.running == 0 and engine.cache.pool.num_used == 0
        metrics = httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=10).text
        assert 'specchat_requests_total{outcome="cancelled"} 1' in metrics  # it was stopped, not run to its end
        # The slot serves the next client at once.
        after = httpx.post(f"{url}/chat/completions", json=_body(2, tokens=5), timeout=60)
        assert after.status_code == 200
