"""Tool calls in the model's own syntax: which syntax a chat template uses, the grammar that makes a reply a call
(``tool_choice`` required or a named function), and the calls read back from a reply's text.

Contract:

- :func:`syntax_of` reads the chat template: ``hermes`` (Qwen2.5, Hermes, SmolLM3 ...: the template writes
  ``<tool_call>``; a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), ``llama3`` (the
  Llama 3.1+ templates: a call is the bare JSON ``{"name": ..., "parameters": {...}}``), or ``default`` for a
  template that does not render tools (the embedded SmolLM2's): the Hermes syntax, taught by a system message
  :func:`prepare` adds (the tools as JSON and the format), with calls and results written into the messages as
  text. ``docs/serve.md`` documents it.
- :func:`prepare` gives the messages and the ``tools`` argument the template renders for a syntax: OpenAI's
  ``tool_calls`` (arguments as a JSON text) become the dicts templates expect; for ``default`` everything is text.
- :func:`call_grammar` is the Lark grammar (llguidance's, with ``%json`` for each tool's parameters) of one or more
  calls to the allowed tools: the reply can only be valid calls.
- :func:`parse_calls` splits a reply into its text and its calls ``[(name, arguments JSON text)]``; text that looks
  like a call but does not parse is left as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from specchat.backend.constraint_spec import JSON_OPTIONS

ToolSyntax = Literal["hermes", "llama3", "default"]
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*(?:</tool_call>|$)", re.S)  # a last call may end at EOS
DEFAULT_SYSTEM = (
    "You can call functions. The functions, as JSON schemas, are:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with one or more blocks, and nothing else:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>\n'
    "A function's result comes back in <tool_response></tool_response> tags."
)


def syntax_of(template: str | None) -> ToolSyntax:
    if not template or "tools" not in template:
        return "default"
    if "<tool_call>" in template:
        return "hermes"
    if "parameters" in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3"
    return "default"


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments", "{}")
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def prepare(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, syntax: ToolSyntax
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the template's ``tools`` argument for ``syntax`` (module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if syntax != "default":
            if calls:
                message = dict(message, tool_calls=[_template_call(c) for c in calls])
            out.append(message)
            continue
        if calls:
            text = "".join(
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}, ensure_ascii=False)
                + "\n</tool_call>\n"
                for c in calls
            )
            out.append({"role": "assistant", "content": (message.get("content") or "") + text})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    if syntax != "default" or not tools:
        return out, tools or None
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = DEFAULT_SYSTEM.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", {})
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": _arguments(call)},
    }


def _call_schema(tool: dict[str, Any], syntax: ToolSyntax) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    key = "parameters" if syntax == "llama3" else "arguments"
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }


def call_grammar(tools: Sequence[dict[str, Any]], syntax: ToolSyntax, parallel: bool = True) -> str:
    """Lark (llguidance) for one call (``parallel``: one or more) to any of ``tools``."""
    schemas = [_call_schema(t, syntax) for t in tools]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = dict(schema, **{"x-guidance": JSON_OPTIONS})
    body = "%json " + json.dumps(schema)
    if syntax == "llama3":
        return f"start: {body}\n"
    repeat = "+" if parallel else ""
    return f'start: call{repeat}\ncall: "<tool_call>\\n" {body} "\\n</tool_call>"\n'


def parse_calls(text: str, syntax: ToolSyntax) -> tuple[str, list[tuple[str, str]]]:
    """(the text outside calls, [(name, arguments as JSON text)]) of a reply."""
    if syntax == "llama3":
        stripped = text.strip()
        if stripped.startswith("{"):
            try:
                value = json.loads(stripped)
            except ValueError:
                return text, []
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                arguments = value.get("parameters", value.get("arguments", {}))
                return "", [(value["name"], json.dumps(arguments, ensure_ascii=False))]
        return text, []
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            value = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append((value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)))
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def call_start(syntax: ToolSyntax) -> str:
    """The text a call starts with: a stream holds back its text from there (the calls are sent whole)."""
    return "{" if syntax == "llama3" else "<tool_call>"
