"""The `openai` SDK against a running `specchat serve` on the embedded default (issue 46): response_format
json_schema and json_object, `chat.completions.parse` with a Pydantic model, tools with tool_choice auto and
required, streamed and not, the round trip call -> tool message -> answer, and /v1/completions. Prints what came
back (a manual check: a 135M model's answers are not judged here, only the shapes and the constraints).

    specchat serve --port 8765 &
    python benchmarks/openai_sdk_structured.py
"""

import json
import sys
import time

import jsonschema
import openai
from pydantic import BaseModel, Field

PORT = sys.argv[1] if len(sys.argv) > 1 else "8765"
client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", max_retries=0)
MODEL = "smollm2-135m"


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float
    landmarks: list[str] = Field(max_length=3)


schema = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer"},
        "genre": {"enum": ["fiction", "science", "history"]},
    },
    "required": ["title", "year", "genre"],
    "additionalProperties": False,
}
t = time.perf_counter()
r = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Recommend a book as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": schema, "strict": True}},
    temperature=0,
)
jsonschema.validate(json.loads(r.choices[0].message.content), schema)
print("json_schema:", r.choices[0].message.content, r.choices[0].finish_reason, f"{time.perf_counter() - t:.1f}s")
r = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
    response_format={"type": "json_object"},
    temperature=0,
    max_tokens=200,
)
print("json_object:", r.choices[0].message.content, r.choices[0].finish_reason)
p = client.chat.completions.parse(
    model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], response_format=City, temperature=0
)
print("parse:", repr(p.choices[0].message.parsed))
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]
for stream in (False, True):
    messages = [{"role": "user", "content": "What is the weather in Berlin?"}]
    for choice in ("auto", "required"):
        if not stream:
            r = client.chat.completions.create(
                model=MODEL, messages=messages, tools=tools, tool_choice=choice, temperature=0, max_tokens=120
            )
            msg = r.choices[0].message
            print(
                f"tools {choice} (whole):",
                r.choices[0].finish_reason,
                msg.content,
                [(c.function.name, c.function.arguments) for c in msg.tool_calls or []],
            )
        else:
            calls, content, finish = {}, "", None
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=tools,
                tool_choice=choice,
                temperature=0,
                max_tokens=120,
                stream=True,
            ):
                d = chunk.choices[0].delta
                content += d.content or ""
                for c in d.tool_calls or []:
                    calls[c.index] = c
                finish = chunk.choices[0].finish_reason or finish
            print(
                f"tools {choice} (stream):",
                finish,
                repr(content),
                [(c.id, c.function.name, c.function.arguments) for c in calls.values()],
            )
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="required", temperature=0, max_tokens=120
    )
    msg = r.choices[0].message
    call = msg.tool_calls[0]
    messages += [
        msg.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature": 3, "unit": "celsius", "sky": "cloudy"}),
        },
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=60, stream=stream
    )
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    else:
        text = answer.choices[0].message.content
    print(f"round trip ({'stream' if stream else 'whole'}): answer:", repr(text))
c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
print("completions:", repr(c.choices[0].text), c.choices[0].finish_reason)
