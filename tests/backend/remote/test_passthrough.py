"""A remote pair passes constraints and logprobs on to its server (issue 46): the fields per server kind, a refusal
naming what the kind cannot take, and a JSON schema and logprobs through a real `specchat serve` on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from char_tokenizer import char_engine
from serve_fixtures import remote_pair, running_server
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.app.serve.boundary import Limits
from specchat.backend.api import ConstraintSpec, GenerationRequest, SamplingParams
from specchat.backend.errors import RequestError
from specchat.backend.remote.client import RemoteEngine

PROMPT = [{"role": "user", "content": "Give me JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "yy"]}},
    "required": ["a"],
    "additionalProperties": False,
}


def test_fields_per_kind(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9/v1"
    schema = GenerationRequest(
        messages=PROMPT, constraint=ConstraintSpec("json_schema", json.dumps(SCHEMA)), logprobs=2
    )
    grammar = GenerationRequest(messages=PROMPT, constraint=ConstraintSpec("grammar", 'root ::= "a"'))
    regex = GenerationRequest(messages=PROMPT, constraint=ConstraintSpec("regex", "[ab]+"))
    for kind in ("openai", "vllm", "sglang", "llama-server", "specchat"):
        engine = RemoteEngine(remote_pair(tmp_path, url, kind=kind, name=kind))
        body = engine.request_body(schema)
        assert body["response_format"]["json_schema"]["schema"] == SCHEMA
        assert body["logprobs"] is True and body["top_logprobs"] == 2
        if kind in ("llama-server", "vllm", "sglang"):
            assert 'root ::= "a"' in engine.request_body(grammar).values()
        else:
            with pytest.raises(RequestError, match=f"a {kind} server, whose API takes no grammar"):
                engine.request_body(grammar)
        if kind in ("vllm", "sglang"):
            assert "[ab]+" in engine.request_body(regex).values()
    with pytest.raises(RequestError, match="tool calls"):
        RemoteEngine(remote_pair(tmp_path, url)).request_body(GenerationRequest(messages=PROMPT, tools=[{}]))


def test_a_schema_and_logprobs_through_specchat_serve(tmp_path: Path) -> None:
    with running_server(char_engine(drafter="none"), limits=Limits(max_tokens=100)) as (_, url):
        remote = RemoteEngine(remote_pair(tmp_path, url))
        request = GenerationRequest(
            messages=PROMPT,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=60),
            constraint=ConstraintSpec("json_schema", json.dumps(SCHEMA)),
            logprobs=1,
        )
        events = list(remote.generate(request))
    jsonschema.validate(json.loads("".join(e.text for e in events)), SCHEMA)
    logprobs = [x for e in events for x in e.logprobs or []]
    assert logprobs and all(x["logprob"] <= 0 and len(x["top"]) == 1 for x in logprobs)
