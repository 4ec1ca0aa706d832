"""`specchat serve`'s prefix cache (issue 35 item 5): a client resending its conversation plus one message prefills
only the new tokens, says so in ``usage.prompt_tokens_details.cached_tokens`` (the stream's usage chunk too), and
replies as a server without the cache does; clients (address + ``prompt_cache_key`` or ``user``) never start from
each other's prompts unless the operator shares state."""

from __future__ import annotations

import json

import httpx
import pytest
from engine_fixtures import tiny_engine
from serve_fixtures import running_server
from tiny_models import random_ids

from specchat.app.serve.boundary import Limits

CONTEXT = 4096
LIMITS = Limits(max_body_bytes=1 << 20, max_tokens=64)


def words(n: int, seed: int) -> str:
    return " ".join(f"w{i}" for i in random_ids(n, seed=seed, low=6))


# About 2,000 tokens: a system prompt and eight turns, ending with the user's message.
CONVERSATION = [{"role": "system", "content": words(300, 0)}] + [
    {"role": "user" if i % 2 == 0 else "assistant", "content": words(200, i + 1)} for i in range(9)
]


def _body(messages, **extra) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0, **extra}


def _post(url: str, body: dict) -> dict:
    response = httpx.post(url + "/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _engine(budget_mb: int = 64):
    return tiny_engine(context_length=CONTEXT, prefix_cache_bytes=budget_mb << 20)


def _next_turn(messages, reply: str, seed: int) -> list[dict]:
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": words(12, seed)}]


def test_a_resent_conversation_prefills_only_the_new_message_and_replies_as_without_the_cache() -> None:
    with running_server(_engine(), limits=LIMITS) as (_, url):
        first = _post(url, _body(CONVERSATION))
        assert first["usage"]["prompt_tokens"] >= 2000
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second_messages = _next_turn(CONVERSATION, first["choices"][0]["message"]["content"], 50)
        seeded = {"temperature": 0.9, "seed": 77}
        warm = [_post(url, _body(second_messages)), _post(url, _body(second_messages + [], **seeded))]
    usage = warm[0]["usage"]
    assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] <= 100
    assert warm[0]["timings"]["prompt_n"] == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    with running_server(_engine(budget_mb=0), limits=LIMITS) as (_, url):
        cold = [_post(url, _body(second_messages)), _post(url, _body(second_messages, **seeded))]
    assert cold[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    for hot, fresh in zip(warm, cold):
        assert hot["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]


def test_the_streams_usage_chunk_counts_the_cached_tokens() -> None:
    with running_server(_engine(), limits=LIMITS) as (_, url):
        first = _post(url, _body(CONVERSATION))
        body = _body(
            _next_turn(CONVERSATION, first["choices"][0]["message"]["content"], 51),
            stream=True,
            stream_options={"include_usage": True},
        )
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert (
        chunks[-1]["choices"] == [] and usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 100
    )


@pytest.mark.parametrize("share_state", [False, True])
def test_clients_start_only_from_their_own_prompts_unless_state_is_shared(share_state: bool) -> None:
    with running_server(_engine(), limits=LIMITS, share_state=share_state) as (server, url):
        a = _post(url, _body(CONVERSATION, prompt_cache_key="agent-a"))
        b = _post(url, _body(CONVERSATION, user="agent-b"))  # `user` names a client too (older clients)
        b_cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert b_cached == (b["usage"]["prompt_tokens"] if share_state else 0)
        # a's next turn still starts from a's own entry: b's request neither read nor spoiled it.
        turn = _post(url, _body(_next_turn(CONVERSATION, a["choices"][0]["message"]["content"], 52),
                                prompt_cache_key="agent-a"))  # fmt: skip
        assert turn["usage"]["prompt_tokens"] - turn["usage"]["prompt_tokens_details"]["cached_tokens"] <= 100
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]  # lossless either way


def test_a_bad_prompt_cache_key_is_refused_naming_the_field() -> None:
    with running_server(_engine(), limits=LIMITS) as (_, url):
        for bad in (12, "k" * 257, ["a"]):
            response = httpx.post(url + "/chat/completions", json=_body(CONVERSATION[:2], prompt_cache_key=bad))
            assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_cache_key"


def test_the_scope_is_the_clients_address_with_its_key() -> None:
    from starlette.requests import Request

    from specchat.app.serve.boundary import parse_chat_request
    from specchat.app.serve.routes import cache_scope

    def scope(host: str, body: dict, shared: bool = False) -> str:
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": [], "client": (host, 40000)})
        call = parse_chat_request(json.dumps(_body(CONVERSATION[:2], **body)).encode(), ["tiny"])
        return cache_scope(request, call, shared)

    assert scope("10.0.0.1", {}) != scope("10.0.0.2", {})  # two machines, no key: two clients
    assert scope("10.0.0.1", {"prompt_cache_key": "k"}) != scope("10.0.0.2", {"prompt_cache_key": "k"})
    assert scope("10.0.0.1", {"prompt_cache_key": "k"}) != scope("10.0.0.1", {"prompt_cache_key": "j"})
    assert scope("10.0.0.1", {"user": "k"}) == scope("10.0.0.1", {"prompt_cache_key": "k"})
    assert scope("10.0.0.1", {"user": "a"}, shared=True) == scope("10.0.0.2", {}, shared=True)
