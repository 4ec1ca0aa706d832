"""`specchat serve`'s ``POST /v1/completions`` (OpenAI's legacy text completions, for base models): a prompt string
continued as it is, no chat template.

Contract: :func:`parse_text_request` checks a body as the chat route does (every sampling field, ``stream``,
``stream_options``, ``seed``, ``stop``, ``specchat``, ``response_format`` ... through
:func:`~specchat.app.serve.boundary.parse_chat_request`) with ``prompt`` instead of ``messages``: a non-empty
string, or a list of exactly one string, or a list of token ids; the prompt is encoded with the model's tokenizer
(its BOS added as the tokenizer does). ``echo``, ``suffix``, ``best_of`` > 1, ``tools`` are refused (400 naming
them). The reply's objects (app/serve/structured.py) are ``text_completion`` ones: ``choices[0]`` has ``text``,
``index``, ``logprobs``, ``finish_reason``, with the same usage, timings and metrics as chat.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from specchat.app.serve.boundary import ApiError, ChatCall, Limits, _bad, decode_json, parse_chat_request
from specchat.backend.tool_calls import syntax_of


def _prompt(value: Any, encode: Callable[[str], list[int]], vocab: int) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str) and value:
        return encode(value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not all(0 <= t < vocab for t in value):
            raise _bad("prompt", value, f"holds a token id outside the model's vocabulary (0 .. {vocab - 1})")
        return list(value)
    raise _bad("prompt", value, "must be a non-empty string, a list of one string, or a list of token ids")


def parse_text_request(
    body: bytes, served: Sequence[str], limits: Limits, encode: Callable[[str], list[int]], vocab: int
) -> ChatCall:
    data = decode_json(body)
    if not isinstance(data, dict):
        raise _bad("body", data, "must be a JSON object with model and prompt")
    if data.get("echo") not in (None, False):
        raise _bad("echo", data["echo"], "is not supported; leave it out")
    if data.get("suffix") not in (None, ""):
        raise _bad("suffix", data["suffix"], "is not supported (no fill-in-the-middle); leave it out")
    if data.get("best_of") not in (None, 1):
        raise _bad("best_of", data["best_of"], "this server returns one completion; send 1 or leave it out")
    if data.get("tools"):
        raise _bad("tools", data["tools"], "tool calls need chat messages: use /v1/chat/completions")
    if data.get("logprobs") is not None and data.get("logprobs") is not False:
        data["top_logprobs"], data["logprobs"] = data["logprobs"], True  # the legacy field counts the top ones
    if "prompt" not in data:
        raise _bad("prompt", None, "is required: the text to continue")
    chat = {key: value for key, value in data.items() if key not in ("prompt", "messages")}
    chat["messages"] = [{"role": "user", "content": "-"}]  # checked as a chat body; the messages are replaced
    call = parse_chat_request(json.dumps(chat).encode(), served, limits)
    ids = _prompt(data["prompt"], encode, vocab)
    request = dataclasses.replace(call.request, messages=None, prompt_ids=ids, keep_all_messages=False)
    return dataclasses.replace(call, request=request, text=True)


def parse_call(body: bytes, served: Sequence[str], limits: Limits, engine: Any, text: bool) -> ChatCall:
    """A chat body (``text`` False: the model's tool syntax from its chat template) or a completions body (the
    prompt encoded with its tokenizer), checked."""
    tokenizer = getattr(engine, "tokenizer", None)
    if not text:
        return parse_chat_request(body, served, limits, syntax_of(getattr(tokenizer, "chat_template", None)))
    if tokenizer is None:
        raise ApiError(400, "this server cannot encode a prompt: use /v1/chat/completions", "prompt")
    return parse_text_request(body, served, limits, tokenizer.encode, len(tokenizer))
