"""Fuzzing ``specchat generate --prompts FILE.jsonl`` (app/cli/generate.py ``read_prompts``, issue 20 items 8 and
13): any file either gives prompts the engine accepts or one RequestError naming the file and line, short
whatever the line holds. Fails on the code before issue 20: a 5,000-digit number raised ValueError inside the JSON
decoder, and a 200,000-item role list made a 1.5 MB error line."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st
from reliability import JSON_RAW, SCALES, dump_json, fuzz, values

from specchat.app.cli.generate import read_prompts
from specchat.backend.api import GenerationRequest
from specchat.backend.errors import RequestError

GOOD = {"id": "p1", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}


def _line(data: tuple) -> bytes:
    where, value = data
    item = json.loads(json.dumps(GOOD))
    if where == "id":
        item["id"] = value
    elif where == "messages":
        item["messages"] = value
    elif where == "line":
        return dump_json(value).encode("utf-8", "surrogatepass")
    else:
        item["messages"][1][where] = value
    return dump_json(item).encode("utf-8", "surrogatepass")


LINES = st.one_of(
    st.tuples(st.sampled_from(["id", "messages", "role", "content", "line", "extra"]), values(JSON_RAW)).map(_line),
    st.binary(max_size=80),
    st.tuples(st.just(json.dumps(GOOD).encode()), st.integers(min_value=0, max_value=90)).map(lambda t: t[0][: t[1]]),
)
FILES = st.lists(st.one_of(st.just(json.dumps(GOOD).encode()), LINES), min_size=1, max_size=4)


@SCALES
def test_any_prompts_file_gives_valid_prompts_or_names_the_line(tmp_path: Path, scale: int) -> None:
    file = tmp_path / "prompts.jsonl"

    def check(lines: list[bytes]) -> None:
        file.write_bytes(b"\n".join(lines) + b"\n")
        try:
            prompts = read_prompts(str(file))
        except RequestError as error:
            message = str(error)
            assert str(file) in message and "\n" not in message and len(message) < 1000, message[:3000]
        else:
            for pid, messages in prompts:
                pid.encode("utf-8")  # printable as UTF-8
                GenerationRequest(messages=messages)  # the engine's own check accepts them

    fuzz("--prompts JSONL", FILES, check, 200 * scale)


def test_the_classes_of_the_issue_are_named(tmp_path: Path) -> None:
    file = tmp_path / "prompts.jsonl"
    for line, expected in [
        (b'{"id": ' + b"9" * 5000 + b', "messages": []}', ":1: not valid JSON (a number with 5000 digits"),
        (json.dumps({"messages": [{"role": ["user"] * 200_000, "content": "x"}]}).encode(), "has role ['user', "),
        (b'{"id": NaN, "messages": []}', "NaN is not a JSON number"),
    ]:
        file.write_bytes(line)
        try:
            read_prompts(str(file))
        except RequestError as error:
            assert expected in str(error) and len(str(error)) < 400, str(error)[:400]
        else:
            raise AssertionError(f"accepted {line[:60]!r}")
