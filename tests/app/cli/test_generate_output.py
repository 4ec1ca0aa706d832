"""`specchat generate` progress on stderr: redrawn in place on a terminal, plain lines elsewhere (issue 19: a
redirected stderr got ``\\r\\x1b[2K`` sequences)."""

from __future__ import annotations

import io

import pytest

from specchat.app.cli import generate


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def report(stream: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(generate, "_last_step", [])
    for i in range(5):
        generate._progress("Hashing model.gguf", i / 4)
    generate._progress("Loading weights: 1/30", 1 / 30)
    generate._progress("Loading weights: 30/30", 1.0)
    generate._progress("Models loaded", 1.0)
    return stream.getvalue()


def test_a_redirected_stderr_gets_one_plain_line_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    text = report(io.StringIO(), monkeypatch)
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == ["Hashing model.gguf", "Loading weights: 1/30", "Models loaded"]


def test_a_terminal_gets_the_line_redrawn_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    text = report(Terminal(), monkeypatch)
    assert text.count("\r\x1b[2K") == 8 and text.endswith("Models loaded 100%\n")
