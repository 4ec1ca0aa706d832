"""Tool-call syntaxes (backend/tool_calls.py): which one a chat template uses, the documented default for templates
without tools (the tools in a system message, calls and results written into the messages), the grammar of a
call for each syntax (checked with llguidance), and calls read back."""

from __future__ import annotations

import json

import llguidance

from specchat.backend.tool_calls import DEFAULT_SYSTEM, call_grammar, parse_calls, prepare, syntax_of

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_the_syntax_comes_from_the_template():
    assert syntax_of(None) == syntax_of("{{ messages }}") == "default"
    assert syntax_of("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert syntax_of("{% if tools %}<|python_tag|> parameters{% endif %}") == "llama3"


def test_the_default_writes_tools_calls_and_results_into_the_messages():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    out, tools = prepare(messages, [TOOL], "default")
    assert tools is None and out[0]["content"].startswith("Be brief.\n\n" + DEFAULT_SYSTEM.split("{")[0])
    assert json.dumps(TOOL) in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}
    templated, tools = prepare(messages, [TOOL], "hermes")
    assert tools == [TOOL] and templated[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # a dict


def _accepts(grammar: str, text: str) -> bool:
    tok = llguidance.LLTokenizer("byte")
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = tok.tokenize_str(text)
    return not m.is_error() and m.validate_tokens(ids) == len(ids)


def test_call_grammars_and_reading_calls_back():
    hermes = call_grammar([TOOL], "hermes")
    assert _accepts(hermes, '<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>')
    assert not _accepts(hermes, '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    llama = call_grammar([TOOL], "llama3")
    assert _accepts(llama, '{"name": "f", "parameters": {"a": 3}}')
    assert parse_calls('{"name": "f", "parameters": {"a": 3}}', "llama3") == ("", [("f", '{"a": 3}')])
    assert parse_calls("just text", "llama3") == ("just text", [])
    text, calls = parse_calls('ok <tool_call>{"name": "f", "arguments": {}}</tool_call>', "hermes")
    assert text == "ok" and calls == [("f", "{}")]
