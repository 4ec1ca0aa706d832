"""What a remote pair passes on to its server for constrained decoding and log-probabilities (issue 46), and the
log-probabilities read back.

Contract: :func:`structured_fields` maps a request's constraint and ``logprobs`` to the server's fields: a JSON
schema or JSON object to ``response_format`` (every kind: the OpenAI API, vLLM, SGLang, llama-server, specchat); a
grammar to llama-server's ``grammar`` (GBNF), vLLM's ``guided_grammar`` or SGLang's ``ebnf``; a regular expression
to vLLM's ``guided_regex`` or SGLang's ``regex``; ``logprobs`` / ``top_logprobs`` as OpenAI's. A constraint the
server's API has no field for, and tools (the API's tool calls are not read back into a stream of text), are a
RequestError naming the pair and what to do. :func:`read_logprobs` turns a chunk's ``choices[0].logprobs`` (OpenAI's
chat shape) into StepEvent's (``id`` -1 where the server sent no token ids).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from specchat.backend.api import GenerationRequest
from specchat.backend.errors import RequestError

_GRAMMAR = {"llama-server": "grammar", "vllm": "guided_grammar", "sglang": "ebnf"}
_REGEX = {"vllm": "guided_regex", "sglang": "regex"}


def structured_fields(request: GenerationRequest, kind: str, pair: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if request.tools:
        raise RequestError(f"pair '{pair}' runs on a server: tool calls are offered by local pairs only")
    spec = request.constraint
    if spec is not None and spec.kind == "json_schema":
        schema = json.loads(spec.text)
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": schema, "strict": True},
        }
    elif spec is not None and spec.kind == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif spec is not None:
        field = (_GRAMMAR if spec.kind == "grammar" else _REGEX).get(kind)
        if field is None:
            raise RequestError(
                f"pair '{pair}' runs on a {kind} server, whose API takes no {spec.kind}; use a JSON schema, a local "
                f"pair, or a server that does ({', '.join(_GRAMMAR if spec.kind == 'grammar' else _REGEX)})"
            )
        out[field] = spec.text
    if request.logprobs is not None:
        out["logprobs"] = True
        out["top_logprobs"] = request.logprobs
    return out


def read_logprobs(choice: Mapping[str, Any], ids: list[int]) -> list[dict[str, Any]] | None:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list):
        return None
    out = []
    for i, item in enumerate(content):
        if not isinstance(item, Mapping) or not isinstance(item.get("logprob"), (int, float)):
            continue
        top = [
            (str(t.get("token", "")), -1, float(t["logprob"]))
            for t in item.get("top_logprobs") or []
            if isinstance(t, Mapping) and isinstance(t.get("logprob"), (int, float))
        ]
        token_id = ids[i] if len(ids) == len(content) else -1
        out.append({"token": str(item.get("token", "")), "id": token_id, "logprob": float(item["logprob"]), "top": top})
    return out
