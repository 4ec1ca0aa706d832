"""`specchat serve` keeps clients apart (issue 37): a second client's reply — its text, tokens, drafts and every
statistic that is not a clock reading — is the same whether or not another client used the server before it,
unless the operator opts in with ``share_state``. Plus the request spellings common clients send, and a prompt
longer than the context refused with 400 instead of cut."""

from __future__ import annotations

import json

import httpx
import pytest
from engine_fixtures import tiny_engine
from serve_fixtures import running_server

# Fields that read a clock (or estimates made from one): they differ between any two runs.
CLOCK = {
    "wall_s",
    "prefill_s",
    "ttft_s",
    "tok_s",
    "draft_s",
    "verify_s",
    "overhead_s",
    "spec_tok_s",
    "plain_tok_s",
    "expected_speedup",
    "policy",
    "seed",
    "pass_s",  # step_counts' timings
    "spec_time_s",
    "plain_time_s",
}
PROMPT = "w7 w8 w9 w10 w11 w7 w8 w9 w10 w11 w7 w8"


def _body(content: str, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "specchat": {"drafter": "suffix", "gamma": 4},
        **extra,
    }


def _counts(stats: dict) -> dict:
    """A reply's statistics without the clock readings, those inside ``step_counts`` too."""
    kept = {k: v for k, v in stats.items() if k not in CLOCK}
    if isinstance(kept.get("step_counts"), dict):
        kept["step_counts"] = {k: v for k, v in kept["step_counts"].items() if k not in CLOCK}
    return kept


def _seen(url: str, body: dict) -> dict:
    """What a client sees of one streamed reply, clock readings left out."""
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    steps = [
        {k: v for k, v in c["specchat"].items() if k != "stats"} | {"stats": _counts(c["specchat"]["stats"])}
        for c in chunks
        if c["choices"]
    ]
    last = chunks[-1]
    metrics = last["metrics"]["speculative_decoding"]
    return {
        "text": "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]),
        "ids": [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]],
        "steps": steps,
        "usage": last["usage"],
        "draft_counts": {k: last["timings"][k] for k in ("draft_n", "draft_n_accepted", "prompt_n", "predicted_n")},
        "metrics": metrics,
        "stats": _counts(last["specchat"]["stats"]),
    }


def _second_client(share_state: bool, first: str | None) -> dict:
    with running_server(tiny_engine(context_length=512), share_state=share_state) as (_, url):
        if first is not None:
            for _ in range(2):  # the first client asks twice: its replies would seed any shared memory
                # Another client: its own prefix-cache key (the address alone is shared by every local program).
                _seen(url, _body(first, prompt_cache_key="first-client"))
        return _seen(url, _body(PROMPT))


def test_a_second_clients_reply_carries_nothing_of_the_first() -> None:
    alone = _second_client(False, None)
    after = _second_client(False, PROMPT)  # the same words: the strongest case for a leak
    assert after == alone
    assert alone["stats"]["drafted"] > 0  # the suffix drafter did run for the second client


def test_with_shared_state_the_first_client_shows_in_the_second_ones_drafts() -> None:
    # The same check fails when the operator opts in: it is able to see a leak.
    alone = _second_client(True, None)
    after = _second_client(True, PROMPT)
    assert after["text"] == alone["text"] and after["ids"] == alone["ids"]  # lossless either way
    assert after["stats"]["accepted"] > alone["stats"]["accepted"]  # drafted from the first client's replies


@pytest.fixture(scope="module")
def served():
    with running_server(tiny_engine(context_length=128)) as (server, url):
        yield url


def test_what_openai_and_vllm_clients_send_is_accepted(served) -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "w1 w2 w3"}], "name": "ann"},
        ],
        "top_k": -1,  # vLLM / SGLang: off
        "seed": -1,  # llama.cpp: random
        "max_tokens": -1,  # llama.cpp: the server's default
        "max_completion_tokens": None,
        "stop": [],
        "n": 1,
        "logprobs": False,
        "top_logprobs": 0,
        "logit_bias": {},
        "min_p": 0,
        "tool_choice": "none",
        "tools": [],
        "presence_penalty": 0.0,
        "frequency_penalty": 0,
        "response_format": {"type": "text"},
        "stream": False,
        "stream_options": None,
        "user": "someone",
        "store": False,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": 0.7,
        "top_p": 1,
    }
    response = httpx.post(served + "/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["timings"]["draft_n"] >= 0 and "speculative_decoding" in answer["metrics"]  # always both


def test_timings_and_metrics_are_in_every_non_streaming_reply(served) -> None:
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4}
    answer = httpx.post(served + "/chat/completions", json={**plain, "specchat": {"drafter": "none"}}, timeout=60)
    body = answer.json()
    assert body["timings"]["draft_n"] == 0 and body["metrics"]["speculative_decoding"]["num_draft_tokens"] == 0
    assert body["metrics"]["speculative_decoding"]["draft_acceptance_rate"] is None


def test_a_prompt_longer_than_the_context_is_refused_not_cut(served) -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"w{i} " * 20} for i in range(41)]
    response = httpx.post(served + "/chat/completions", json={"model": "tiny", "messages": messages}, timeout=60)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "tokens" in message and "context" in message and "fewer or shorter" in message
