"""`specchat generate --json-schema FILE` / `--grammar FILE` (issue 46): the file's boundary. Every refusal names the
flag and the file and says what is wrong, before any model loads."""

from __future__ import annotations

import json

import pytest

from specchat.app.cli.generate import read_constraint
from specchat.backend.errors import RequestError


def test_a_schema_and_a_grammar_are_read(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}), encoding="utf-8")
    spec = read_constraint(str(schema), None)
    assert spec.kind == "json_schema" and json.loads(spec.text)["properties"]["a"] == {"type": "integer"}
    assert spec.jump_forward and not read_constraint(str(schema), None, jump_forward=False).jump_forward
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n', encoding="utf-8")
    assert read_constraint(None, str(gbnf)).kind == "grammar"
    assert read_constraint(None, None) is None


@pytest.mark.parametrize(
    ("content", "flag", "says"),
    [
        (None, "--json-schema", "does not exist"),
        (b"\xff\xfe", "--json-schema", "not UTF-8"),
        (b"{not json", "--json-schema", "not valid JSON"),
        (b"[1, 2]", "--json-schema", "a JSON schema is an object"),
        (b'{"type": "strin"}', "--json-schema", "not supported"),
        (b"root ::= (", "--grammar", "--grammar file"),
    ],
)
def test_bad_files_are_refused_by_name(tmp_path, content, flag, says):
    path = tmp_path / "bad.txt"
    if content is not None:
        path.write_bytes(content)
    args = (str(path), None) if flag == "--json-schema" else (None, str(path))
    with pytest.raises(RequestError) as caught:
        read_constraint(*args)
    assert flag in str(caught.value) and "bad.txt" in str(caught.value) and says in str(caught.value)
