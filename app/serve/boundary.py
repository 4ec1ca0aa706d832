"""The input boundary of `specchat serve`: one HTTP request body in, a checked :class:`ChatCall` out, or an
:class:`ApiError` that names the bad field. Nothing past this module sees an unchecked value.

Contract: :func:`parse_chat_request` ``(body, served, limits)`` takes the raw bytes of a ``POST
/v1/chat/completions`` body and the served model ids (pair names). It raises :class:`ApiError` (an HTTP status,
a message that names the field and what to send, ``param`` = the field's path) for: a body that is not UTF-8
JSON (400), a top level that is not an object (400), a missing or unknown ``model`` (400 / 404 with the served
list), ``messages`` that are not a non-empty list of ``{"role": system|user|assistant, "content": text or text
parts}`` (400), sampling values out of the engine's range (``specchat.backend.limits.SAMPLING_LIMITS``: 400),
``max_tokens`` over the server's limit (400), OpenAI features the server does not offer when asked for (``n`` >
1, ``functions``, ``logit_bias``: 400; ``tools``, ``response_format`` and ``logprobs`` are read by
app/serve/structured.py and here), and more than ``limits.max_messages`` messages (413, before any message is
read). Other unknown fields are ignored, as OpenAI-compatible servers do.
The spellings common clients send for "off" or "default" are accepted (:func:`_normalise`): ``top_k`` -1
(vLLM, SGLang), ``seed`` -1 and ``max_tokens`` -1 (llama.cpp's "none"), the role ``developer`` (OpenAI's newer
name for ``system``), an empty ``stop``, ``logit_bias`` {}, ``min_p`` 0, ``top_logprobs`` 0, ``tool_choice``
"none" or "auto" without tools. ``prediction`` (OpenAI's Predicted Outputs: ``{"type": "content", "content":
text or text parts}``) drafts the reply from that text (issue 35); anything else there is a 400 naming it.
``prompt_cache_key`` (OpenAI's; a text of at most 256 characters, else 400), or else a text ``user``, is
:attr:`ChatCall.cache_key`: together with the client's address it names the prefix-cache scope the request reads
and adds to (app/serve/routes.py). The body size limit is checked by the server before reading (413).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specchat.app.serve.structured import FieldError, ToolPlan, message_fields, parse_structured
from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.errors import RequestError
from specchat.backend.limits import (
    DRAFTERS,
    MAX_PREDICTION_CHARS,
    SERVE_MAX_TOKENS,
    check_gamma,
    check_sampling_value,
)
from specchat.backend.tool_calls import ToolSyntax

DEFAULT_MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413) before it is read
DEFAULT_QUEUE = 8  # requests waiting for the engine; one more is refused (429)
DEFAULT_MAX_MESSAGES = 2048  # messages in one request (OpenAI's own limit); more are refused (413)
DEFAULT_MAX_CONNECTIONS = 64  # open at once; more are refused (503: app/serve/protocol.py)
MAX_STOP_STRINGS = 16
ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer clients send "developer" for the system message


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a message naming the field, and the field's path."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error object."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int = SERVE_MAX_TOKENS  # per reply; a request asking for more is refused (400)
    max_messages: int = DEFAULT_MAX_MESSAGES


@dataclass(frozen=True, slots=True)
class ChatCall:
    """One checked chat completions call."""

    model: str
    request: GenerationRequest
    stream: bool
    include_usage: bool
    return_token_ids: bool
    cache_key: str = ""  # prompt_cache_key, else user, else "" (see the module docstring)
    tools: ToolPlan | None = None  # tools offered: the reply's calls are read back (app/serve/structured.py)
    text: bool = False  # a /v1/completions call (app/serve/completions.py)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(param: str, value: Any, what: str) -> ApiError:
    return ApiError(400, f"field '{param}' = {_shown(value)}: {what}", param)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def decode_json(body: bytes) -> Any:
    """The body as JSON; ApiError 400 saying where it is malformed."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not UTF-8 (byte {error.start}); send UTF-8 JSON", "body") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise ApiError(
            400,
            f"the request body is not valid JSON ({error.msg} at line {error.lineno} column "
            f"{error.colno}); send a JSON object",
            "body",
        ) from None
    except (ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ApiError(400, f"the request body is not valid JSON ({reason}); send a JSON object", "body") from None


def _content(index: int, content: Any) -> str:
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text ones can be read here
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(
                    f"{param}[{j}]", part, 'must be {"type": "text", "text": "..."} (this server reads text only)'
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(param, content, "must be a string or a list of text parts")


def _messages(value: Any, most: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", value, 'must be a non-empty list of {"role": ..., "content": ...} objects')
    if len(value) > most:
        raise ApiError(
            413,
            f"field 'messages' has {len(value)} messages; this server takes at most {most} (--max-messages): "
            "send fewer, e.g. drop the oldest turns",
            "messages",
        )
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise _bad(f"messages[{i}]", message, 'must be an object {"role": ..., "content": ...}')
        role = message.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", role, "must be one of " + ", ".join(ROLES) + " (or developer)")
        try:
            fields = message_fields(i, message, str(role))  # an assistant's tool_calls, a tool's tool_call_id
        except FieldError as error:
            raise _bad(error.param, error.value, error.what) from None
        if message.get("content") is None and "tool_calls" not in fields:
            raise _bad(f"messages[{i}].content", None, "is required (text)")
        content = message.get("content")
        text = "" if content is None else _content(i, content).encode("utf-8", "replace").decode("utf-8")
        out.append({"role": str(role), "content": text, **fields})
    if not any(m["role"] == "user" for m in out):
        raise _bad("messages", f"{len(out)} message(s)", "has no user message; add one")
    if out[-1]["role"] == "user" and not out[-1]["content"].strip():
        raise _bad(f"messages[{len(out) - 1}].content", out[-1]["content"], "the last user message is empty")
    return out


def _number(body: Mapping[str, Any], key: str, ours: str) -> Any:
    if key not in body or body[key] is None:
        return None
    value = body[key]
    if value == -1 and not isinstance(value, bool) and key in OFF_AT_MINUS_ONE:
        return OFF_AT_MINUS_ONE[key]
    try:
        check_sampling_value(ours, value)
    except RequestError as error:
        off = " (or -1: off)" if key in OFF_AT_MINUS_ONE else ""
        raise ApiError(400, f"field '{key}' = {_shown(value)}: {str(error).split(': ', 1)[-1]}{off}", key) from None
    return value


# Clients send -1 for "off" / "server's choice" (vLLM and SGLang top_k, llama.cpp seed): what it means here.
OFF_AT_MINUS_ONE: dict[str, Any] = {"top_k": 0, "seed": None}


def _stop(value: Any) -> tuple[str, ...]:
    if value is None or value == "" or value == []:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in items)
    ):
        raise _bad(
            "stop", value, f"must be a string or a list of at most {MAX_STOP_STRINGS} strings of 1-256 characters"
        )
    return tuple(items)


def _flag(body: Mapping[str, Any], key: str, param: str | None = None) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(param or key, value, "must be true or false")
    return value


def _unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise _bad("n", n, "this server returns one choice per request; send n: 1 or leave it out")
    if body.get("logit_bias") not in (None, {}):
        raise _bad("logit_bias", body["logit_bias"], "is not supported; send {} or leave it out")
    min_p = body.get("min_p")
    if min_p is not None and (not isinstance(min_p, (int, float)) or isinstance(min_p, bool) or min_p != 0):
        raise _bad("min_p", min_p, "is not supported; send 0 or leave it out (top_p and top_k are)")


def _logprobs(body: Mapping[str, Any]) -> int | None:
    """``logprobs`` true: the request's number of ``top_logprobs`` (0-20); None without logprobs."""
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise _bad("top_logprobs", top, "must be a whole number from 0 to 20")
    if not _flag(body, "logprobs"):
        if top:
            raise _bad("top_logprobs", top, "needs logprobs: true")
        return None
    return top or 0


def _specchat(value: Any) -> tuple[Any, Any]:
    if value is None:
        return None, None
    if not isinstance(value, Mapping) or set(value) - {"drafter", "gamma"}:
        raise _bad("specchat", value, 'must be an object with optional "drafter" and "gamma"')
    drafter, gamma = value.get("drafter"), value.get("gamma")
    if drafter is not None and drafter not in DRAFTERS:
        raise _bad("specchat.drafter", drafter, "must be one of " + ", ".join(DRAFTERS))
    if gamma is not None:
        try:
            check_gamma(gamma)
        except RequestError as error:
            raise _bad("specchat.gamma", gamma, str(error)) from None
    return drafter, gamma


def _prediction(value: Any) -> str | None:
    """OpenAI's ``prediction``: ``{"type": "content", "content": "..."}`` or content as a list of text parts."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise _bad("prediction", value, 'must be {"type": "content", "content": TEXT}')
    content = value.get("content")
    if isinstance(content, list) and all(
        isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise _bad("prediction.content", content, 'must be a text or a list of {"type": "text", "text": ...} parts')
    if len(content) > MAX_PREDICTION_CHARS:
        raise _bad("prediction.content", content[:40], f"is longer than {MAX_PREDICTION_CHARS:,} characters")
    return content


MAX_CACHE_KEY_CHARS = 256


def _cache_key(data: Mapping[str, Any]) -> str:
    """``prompt_cache_key`` (checked: a text), else ``user`` when it is a text (as other servers, nothing else is
    refused for it), else ""."""
    key = data.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str) or len(key) > MAX_CACHE_KEY_CHARS:
            raise _bad("prompt_cache_key", key, f"must be a text of at most {MAX_CACHE_KEY_CHARS} characters")
        return key
    user = data.get("user")
    return user[:MAX_CACHE_KEY_CHARS] if isinstance(user, str) else ""


def parse_chat_request(
    body: bytes, served: Sequence[str], limits: Limits = Limits(), tool_syntax: ToolSyntax = "default"
) -> ChatCall:
    """Check one chat completions body (see the module docstring); ``tool_syntax``: the model's (tool_calls.py)."""
    data = decode_json(body)
    if not isinstance(data, dict):
        raise _bad("body", data, "must be a JSON object with model and messages")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", model, "is required: one of " + ", ".join(served))
    if model not in served:
        raise ApiError(
            404,
            f"model {_shown(model[:100])} is not served here; models: {', '.join(served)} (GET /v1/models)",
            "model",
            "model_not_found",
        )
    messages = _messages(data.get("messages"), limits.max_messages)
    _unsupported(data)
    try:
        constraint, tools, plan = parse_structured(data, tool_syntax)
    except FieldError as error:
        raise _bad(error.param, error.value, error.what) from None
    max_key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = data.get(max_key)
    if max_tokens == -1 and not isinstance(max_tokens, bool):  # llama.cpp's "no limit": the server's default
        max_tokens = None
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= limits.max_tokens
    ):
        raise _bad(max_key, max_tokens, f"must be a whole number from 1 to {limits.max_tokens} (this server's limit)")
    temperature = _number(data, "temperature", "temperature")
    top_p = _number(data, "top_p", "top_p")
    top_k = _number(data, "top_k", "top_k")
    repetition_penalty = _number(data, "repetition_penalty", "repetition_penalty")
    seed = _number(data, "seed", "seed")
    for key in ("presence_penalty", "frequency_penalty"):
        value = data.get(key)
        if value is not None and (
            not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value != 0
        ):
            raise _bad(key, value, "is not supported; send 0 or leave it out (repetition_penalty is)")
    stream = _flag(data, "stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise _bad("stream_options", options, 'must be an object such as {"include_usage": true}')
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    drafter, gamma = _specchat(data.get("specchat"))
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            max_new_tokens=max_tokens,  # None: the pair's default
            seed=seed,
            stop=_stop(data.get("stop")),
        )
        request = GenerationRequest(
            messages=messages,
            sampling=sampling,
            drafter=drafter,
            gamma=gamma,
            keep_all_messages=True,
            prediction=_prediction(data.get("prediction")),
            constraint=constraint,
            tools=tools,
            logprobs=_logprobs(data),
        )
    except RequestError as error:  # the checks above cover every field; this keeps the contract if they drift
        raise ApiError(400, str(error), None) from None
    return ChatCall(
        model, request, stream, include_usage, _flag(data, "return_token_ids"), _cache_key(data), tools=plan
    )
