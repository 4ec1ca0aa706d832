"""`specchat serve`'s structured outputs (issue 46), through the real `openai` SDK against a tiny random-weight model
whose chat template defines tools (Qwen2.5 style, tests/support/char_tokenizer.py):

- ``response_format`` json_schema and json_object: every reply parses and validates; ``chat.completions.parse``
  with a Pydantic model gives the parsed object;
- tools: ``tool_choice`` required and a named function give ``tool_calls`` in OpenAI's shape (arguments valid for
  the tool's schema), finish_reason ``tool_calls``, streamed and not; the round trip call -> tool message ->
  answer works;
- a schema the grammar engine cannot take, a tool_choice naming no tool: 400 naming the field;
- reading calls back: text before a call is content, a stream holds back what may start a call.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from char_tokenizer import QWEN_TOOLS, char_engine
from pydantic import BaseModel, Field
from serve_fixtures import running_server
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.app.serve.boundary import Limits
from specchat.app.serve.structured import CallStream, ToolPlan, whole_message

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def client():
    engine = char_engine(template=QWEN_TOOLS)
    with running_server(engine, limits=Limits(max_body_bytes=1 << 20, max_tokens=200)) as (_, url):
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_replies_validate(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, response_format=fmt, seed=seed, temperature=1, max_tokens=150
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    loose = client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, seed=seed, max_tokens=150
    )
    if loose.choices[0].finish_reason == "stop":  # a random model may fill the whole budget with one object
        assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_parse_with_a_pydantic_model(client):
    parsed = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Person, seed=4, max_tokens=150)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 99


def _arguments(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_round_trip(client, choice):
    first = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        parallel_tool_calls=False,  # a random model may go on calling
        seed=7,
        max_tokens=150,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if choice != "required":
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        _arguments(call)
    history = ASK + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 4}'},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER, CLOCK], tool_choice="none", seed=7, max_tokens=20
    )
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)


def test_a_streamed_tool_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=named, seed=8, max_tokens=150, stream=True
    )
    calls, finish, content = {}, None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for item in delta.tool_calls or []:
            calls.setdefault(item.index, item)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not content and calls[0].function.name == "get_weather"
    _arguments(calls[0])
    whole = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=named, seed=8, max_tokens=150
    )
    assert whole.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments  # the same reply


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_structured_fields_are_400_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **extra)
    assert caught.value.body["param"] == param


def test_calls_are_read_back_from_text():
    plan = ToolPlan("hermes", ("f",))
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    message, called = whole_message(text, plan)
    assert called and message["content"] == "Let me look."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    assert whole_message("<tool_call>{not json</tool_call>", plan) == (
        {"role": "assistant", "content": "<tool_call>{not json</tool_call>"},
        False,
    )
    stream = CallStream(plan)
    sent = [stream.push(piece) for piece in ("Let me", " look.\n<tool", "_call>\n{", '"name": "f", "arguments": {}}')]
    assert sent == ["Let me", " look.\n", "", ""]
    assert stream.finish()[1][0]["function"]["name"] == "f"
    held = CallStream(plan)
    assert held.push("a <to") == "a " and held.finish() == ("<to", [])


def test_text_completions(client):
    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, seed=3, temperature=0)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert isinstance(done.choices[0].text, str) and done.usage.completion_tokens <= 12
    pieces = client.completions.create(
        model="tiny", prompt=["Once upon a time"], max_tokens=12, seed=3, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == done.choices[0].text  # streamed: the same
    shaped = client.completions.create(
        model="tiny", prompt="x", max_tokens=100, seed=3, extra_body={"response_format": {"type": "json_object"}}
    )
    if shaped.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(shaped.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", echo=True)
    assert caught.value.body["param"] == "echo"


def test_logprobs_in_openai_shape(client):
    kw = dict(model="tiny", messages=ASK, max_tokens=10, seed=2, temperature=0.7, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and len(content[0].top_logprobs) == 2
    streamed = [t for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # fmt: skip
    assert [t.token for t in streamed] == [t.token for t in content]  # figures: to rounding (tests/backend/engine)
    assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(streamed, content))
    legacy = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == legacy.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, top_logprobs=3)
    assert caught.value.body["param"] == "top_logprobs"
