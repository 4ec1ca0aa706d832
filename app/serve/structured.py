"""`specchat serve`'s structured outputs (issue 46): ``response_format`` (json_object, json_schema), ``tools`` and
``tool_choice``, tool messages in the conversation, and ``tool_calls`` in replies and streams, in OpenAI's shapes.

Contract:

- :func:`parse_structured` reads a body's ``response_format``, ``tools`` and ``tool_choice`` (the model's tool
  syntax given: ``backend/tool_calls.py``) into the request's constraint, its tools and a :class:`ToolPlan`, or
  raises :class:`ApiError` naming the field. ``json_object`` and ``json_schema`` constrain the reply (the schema is
  checked by the grammar engine first: a schema it cannot take is a 400 naming it); ``tool_choice`` ``required``
  or a named function constrains the reply to calls in the model's syntax (a named one: that function only);
  ``auto`` offers the tools and reads back whatever calls the reply makes; ``none`` offers no tools.
- :func:`message_fields` checks a message's tool fields: an assistant's ``tool_calls`` (content may then be null)
  and a ``tool`` message's ``tool_call_id``.
- :class:`CallStream` follows a streamed reply: the text deltas to send (text from where a call starts is held
  back) and, at the end, the calls as ``tool_calls`` deltas; :func:`whole_message` is a non-streamed reply's
  ``message`` and ``finish_reason`` (``tool_calls`` when it made calls).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specchat.app.serve import wire
from specchat.backend.api import ConstraintSpec, StepEvent
from specchat.backend.constraint_spec import check_grammar
from specchat.backend.errors import RequestError
from specchat.backend.tool_calls import ToolSyntax, call_grammar, call_start, parse_calls

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FieldError(Exception):
    """A bad field: app/serve/boundary.py answers it as a 400 naming ``param`` (this module builds on no other)."""

    def __init__(self, param: str, value: Any, what: str) -> None:
        super().__init__(what)
        self.param, self.value, self.what = param, value, what


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a reply's tool calls are read: the model's syntax and the tools offered."""

    syntax: ToolSyntax
    names: tuple[str, ...]


def _checked(spec: ConstraintSpec, param: str) -> ConstraintSpec:
    try:
        check_grammar(spec)
    except RequestError as error:
        raise FieldError(param, spec.text[:60], str(error)) from None
    return spec


def _response_format(value: Any) -> ConstraintSpec | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, (Mapping, bool)):
            raise FieldError(
                "response_format.json_schema",
                spec,
                'must be {"name": ..., "schema": {JSON schema}, "strict": true}: the schema is missing',
            )
        return _checked(ConstraintSpec("json_schema", json.dumps(schema)), "response_format.json_schema.schema")
    raise FieldError(
        "response_format",
        value,
        'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}',
    )


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None or value == []:
        return []
    if not isinstance(value, list):
        raise FieldError("tools", value, 'must be a list of {"type": "function", "function": {...}}')
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise FieldError(f"tools[{i}]", tool, 'must be {"type": "function", "function": {"name": ..., ...}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError(f"tools[{i}].function.name", name, "must be 1-64 letters, digits, _ or -")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise FieldError(f"tools[{i}].function.parameters", parameters, "must be a JSON schema object")
        description = function.get("description")
        clean: dict[str, Any] = {"name": name}
        if isinstance(description, str):
            clean["description"] = description
        clean["parameters"] = dict(parameters) if parameters is not None else {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": clean})
    if len({t["function"]["name"] for t in tools}) != len(tools):
        raise FieldError("tools", [t["function"]["name"] for t in tools], "names a function twice")
    return tools


def _choice(value: Any, tools: list[dict[str, Any]]) -> str:
    """``auto``, ``none``, ``required`` or the named function's name."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise FieldError("tool_choice", value, "needs tools; send tools or leave tool_choice out")
        return str(value)
    function = value.get("function") if isinstance(value, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(value, Mapping) or value.get("type") != "function" or not isinstance(name, str):
        raise FieldError("tool_choice", value, 'must be "auto", "none", "required" or {"type": "function", "function": '
                   '{"name": ...}}')  # fmt: skip
    if name not in {t["function"]["name"] for t in tools}:
        raise FieldError("tool_choice.function.name", name, "is not one of the request's tools")
    return name


def parse_structured(
    data: Mapping[str, Any], syntax: ToolSyntax
) -> tuple[ConstraintSpec | None, list[dict[str, Any]] | None, ToolPlan | None]:
    """(the constraint, the tools the prompt offers, how calls are read back) of a body (module docstring)."""
    if data.get("functions"):
        raise FieldError("functions", data["functions"], "is OpenAI's old form; send tools instead")
    constraint = _response_format(data.get("response_format"))
    tools = _tools(data.get("tools"))
    choice = _choice(data.get("tool_choice"), tools)
    if choice == "none" or not tools:
        return constraint, None, None
    if constraint is not None:
        raise FieldError("response_format", data.get("response_format"), 'with tools, send tool_choice "none" or no '
                   "response_format: a reply is either calls or JSON")  # fmt: skip
    plan = ToolPlan(syntax, tuple(t["function"]["name"] for t in tools))
    if choice != "auto":
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
        parallel = data.get("parallel_tool_calls") is not False and choice == "required"
        constraint = _checked(ConstraintSpec("grammar", call_grammar(chosen, syntax, parallel)), "tools")
    return constraint, tools, plan


def message_fields(index: int, message: Mapping[str, Any], role: str) -> dict[str, Any]:
    """The tool fields of a message, checked (OpenAI's ``tool_calls`` of an assistant, ``tool_call_id`` of a tool
    message); {} for other messages."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise FieldError(f"messages[{index}].tool_calls", calls, "must be a list of tool calls")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            arguments = function.get("arguments") if isinstance(function, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise FieldError(f"messages[{index}].tool_calls[{j}]", call, 'must be {"id", "type": "function", '
                           '"function": {"name", "arguments"}}')  # fmt: skip
            if isinstance(arguments, str):
                try:
                    json.loads(arguments)
                except ValueError:
                    raise FieldError(f"messages[{index}].tool_calls[{j}].function.arguments", arguments,
                               "must be a JSON text") from None  # fmt: skip
        out["tool_calls"] = [dict(call) for call in calls]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise FieldError(f"messages[{index}].tool_call_id", call_id, "must be a text")
        if call_id is not None:
            out["tool_call_id"] = call_id
    return out


def _call_objects(calls: list[tuple[str, str]], with_index: bool) -> list[dict[str, Any]]:
    out = []
    for i, (name, arguments) in enumerate(calls):
        item: dict[str, Any] = {"index": i} if with_index else {}
        item.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
        item["function"] = {"name": name, "arguments": arguments}
        out.append(item)
    return out


def whole_message(text: str, plan: ToolPlan | None) -> tuple[dict[str, Any], bool]:
    """A non-streamed reply's ``message``, and whether it made calls (finish_reason ``tool_calls``)."""
    if plan is None:
        return {"role": "assistant", "content": text}, False
    rest, calls = parse_calls(text, plan.syntax)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": rest or None, "tool_calls": _call_objects(calls, False)}, True


class CallStream:
    """A streamed reply with tools offered: the text to send now (text from where a call may start is held back),
    and the calls at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0
        self.start = call_start(plan.syntax)

    def push(self, text: str) -> str:
        """The content delta to send after ``text`` arrived."""
        self.text += text
        if self.plan.syntax == "llama3":  # a call is the whole reply: hold back a reply that starts like JSON
            stripped = self.text.lstrip()
            safe = self.sent if not stripped or stripped.startswith("{") else len(self.text)
        elif (at := self.text.find(self.start)) >= 0:
            safe = at
        else:  # hold back a tail that may begin a call ("<tool_")
            safe = len(self.text)
            for k in range(min(len(self.start) - 1, len(self.text)), 0, -1):
                if self.start.startswith(self.text[-k:]):
                    safe = len(self.text) - k
                    break
        delta, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return delta

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(the held-back text to send as content, the calls as ``tool_calls`` delta items)."""
        rest, calls = parse_calls(self.text, self.plan.syntax)
        if not calls:
            return self.text[self.sent :], []
        return "", _call_objects(calls, True)


def logprobs(items: list[dict[str, Any]] | None, as_text: bool, offset: int = 0) -> dict[str, Any] | None:
    """A choice's ``logprobs`` from the engine's (StepEvent.logprobs): OpenAI's chat shape (``content``: token,
    logprob, bytes, top_logprobs), or the legacy completions one (tokens, token_logprobs, top_logprobs,
    text_offset, counted from ``offset``)."""
    if items is None:
        return None
    if as_text:
        offsets, at = [], offset
        for item in items:
            offsets.append(at)
            at += len(item["token"])
        return {
            "tokens": [i["token"] for i in items],
            "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": [{text: lp for text, _, lp in i["top"]} for i in items],
            "text_offset": offsets,
        }

    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [dict(one(i["token"], i["logprob"]), top_logprobs=[one(t, lp) for t, _, lp in i["top"]]) for i in items]
    return {"content": content, "refusal": None}


def completion(
    call_id: str, call: Any, events: list[StepEvent], last: StepEvent, spec_tokens: int | None = None
) -> dict[str, Any]:
    """A whole reply (``call``: the ChatCall): wire.completion, with the reply's calls as ``tool_calls``
    (finish_reason ``tool_calls``) when tools were offered, ``logprobs`` when asked; a ``text_completion`` for
    ``/v1/completions``."""
    text = "".join(e.text for e in events)
    ids = [t for e in events for t in e.token_ids] if call.return_token_ids else None
    out = wire.completion(call_id, call.model, text, ids, last, spec_tokens)
    choice = out["choices"][0]
    asked = [i for e in events for i in e.logprobs or []] if call.request.logprobs is not None else None
    choice["logprobs"] = logprobs(asked, call.text)
    if call.text:
        choice["text"] = choice.pop("message")["content"]
        out["object"] = "text_completion"
        out["id"] = "cmpl-" + call_id.removeprefix("chatcmpl-")
    elif call.tools is not None:
        choice["message"], called = whole_message(text, call.tools)
        if called:
            choice["finish_reason"] = "tool_calls"
    return out


class Chunks:
    """wire.chunk for a stream, with tools offered: content deltas held back where a call starts, and the calls as
    one ``tool_calls`` delta on the last chunk (finish_reason ``tool_calls``); ``as_text``: ``text_completion``
    chunks."""

    def __init__(self, plan: ToolPlan | None, as_text: bool = False) -> None:
        self.calls = CallStream(plan) if plan is not None else None
        self.as_text = as_text
        self.offset = 0  # characters sent so far (legacy logprobs' text_offset)

    def _text(self, payload: dict[str, Any]) -> dict[str, Any]:
        payload["id"] = "cmpl-" + payload["id"].removeprefix("chatcmpl-")
        payload["object"] = "text_completion"
        for choice in payload["choices"]:
            choice["text"] = choice.pop("delta").get("content", "")
        return payload

    def usage(
        self, call_id: str, model: str, created: int, last: StepEvent, spec_tokens: int | None = None
    ) -> dict[str, Any]:
        payload = wire.usage_chunk(call_id, model, created, last, spec_tokens)
        return self._text(payload) if self.as_text else payload

    def chunk(
        self, call_id: str, model: str, created: int, event: StepEvent, *, token_ids: bool, first: bool
    ) -> dict[str, Any]:
        payload = wire.chunk(call_id, model, created, event, token_ids=token_ids, first=first)
        payload["choices"][0]["logprobs"] = logprobs(event.logprobs, self.as_text, self.offset)
        self.offset += len(event.text)
        if self.as_text:
            return self._text(payload)
        if self.calls is None:
            return payload
        choice = payload["choices"][0]
        choice["delta"]["content"] = self.calls.push(event.text)
        if event.finish_reason is not None:
            rest, calls = self.calls.finish()
            choice["delta"]["content"] += rest
            if calls:
                choice["delta"]["tool_calls"] = calls
                choice["delta"]["content"] = choice["delta"]["content"] or None
                choice["finish_reason"] = "tool_calls"
        return payload
