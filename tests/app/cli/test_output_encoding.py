"""`specchat generate` on a stdout that is not UTF-8 (app/cli/generate.py, issue 20 item 7): ``--json`` stays exact
(ASCII-only JSON with \\u escapes), text mode writes what the encoding lacks as '?' and says so once on stderr;
nothing crashes and no sample is lost. Fails on the code before issue 20: a UnicodeEncodeError on ascii, cp1252
and latin-1 stdouts lost the sample."""

from __future__ import annotations

import io
import json
import sys

import pytest
from fake_engine import FakeEngine

import specchat.backend.engine.engine as engine_module
from specchat.app.cli.main import main

REPLY = "héllo ☃ 你好 — “quotes” 😀 end"


@pytest.fixture
def fake_reply(isolated_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(engine_module, "load_engine", lambda pair, **kwargs: FakeEngine(pair, reply=REPLY))


def _run(monkeypatch: pytest.MonkeyPatch, capsys, encoding: str, *options: str) -> tuple[int, str, str]:
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding=encoding, errors="strict", newline="\n")
    monkeypatch.setattr(sys, "stdout", stdout)
    code = main(["generate", "--prompt", "hi", "--samples", "2", *options])
    stdout.flush()
    monkeypatch.undo()
    return code, raw.getvalue().decode(encoding), capsys.readouterr().err


@pytest.mark.parametrize("encoding", ["ascii", "cp1252", "latin-1", "utf-8"])
def test_json_is_exact_on_any_stdout(fake_reply, monkeypatch, capsys, encoding: str) -> None:
    code, out, err = _run(monkeypatch, capsys, encoding, "--json")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["text"] for r in records] == [REPLY, REPLY] and "Traceback" not in err
    assert out.isascii() == (encoding != "utf-8")


@pytest.mark.parametrize("encoding", ["ascii", "cp1252", "latin-1", "utf-8"])
def test_text_writes_what_the_encoding_lacks_as_a_question_mark_and_says_so_once(
    fake_reply, monkeypatch, capsys, encoding: str
) -> None:
    code, out, err = _run(monkeypatch, capsys, encoding)
    expected = REPLY.encode(encoding, "replace").decode(encoding)
    assert code == 0 and out.split("\n")[:2] == [expected, expected] and "Traceback" not in err
    assert err.count("cannot show some characters") == (0 if encoding == "utf-8" else 1)
