"""Terminal escapes in text that came from a file or a server never reach the terminal (issue 47, class 4):
`specchat models` printed a pair's description with its colour codes and OSC title sequence; now every
boundary that shows such text (the listing, `generate`'s reply on a terminal, the UI's messages, picker,
history, diff dialog and notifications) passes it through ``backend/redact.terminal_safe``."""

from __future__ import annotations

import io
import json
import re

import pytest

from specchat.app.cli import generate
from specchat.app.cli.main import main
from specchat.backend.redact import terminal_safe

ESCAPES = (
    "red \x1b[31mRED\x1b[0m title \x1b]0;pwned\x07 bell\x07 c1 \x9b2J erase\x1b[2J cr\r back\x08 dcs\x1bPq#0\x1b\\ end"
)
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def test_the_helper_removes_whole_sequences_and_every_control_but_newline_and_tab() -> None:
    assert terminal_safe(ESCAPES) == "red RED title  bell c1  erase cr back dcs end"
    assert terminal_safe("a\tb\nc") == "a\tb\nc"
    assert terminal_safe("\x1b[31") == "31"  # a sequence cut in two: its ESC goes, so nothing acts on the terminal


def test_models_prints_no_escape_of_a_description(tmp_path, capsys) -> None:
    models = tmp_path / "models.yaml"
    text = json.dumps(ESCAPES)  # a YAML double-quoted scalar: its \u escapes are the control characters
    models.write_text(
        f"pairs:\n  - name: esc\n    description: {text}\n    target: {{source: packaged:smollm2-135m-instruct}}\n",
        encoding="utf-8",
    )
    assert main(["models", "--models", str(models), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "red RED title" in out and "pwned" not in out
    assert not CONTROL.search(out.replace("\n", "")), repr(out)


def test_generate_strips_escapes_on_a_terminal_and_keeps_them_exact_in_json(monkeypatch) -> None:
    class Tty(io.StringIO):
        encoding = "utf-8"

        def isatty(self) -> bool:
            return True

    screen = Tty()
    monkeypatch.setattr("sys.stdout", screen)
    out = generate._Stdout()
    out.write(ESCAPES)
    out.json_line({"text": ESCAPES})
    shown, line = screen.getvalue().split("end", 1)
    assert not CONTROL.search(shown) and not CONTROL.search(line.strip())
    assert json.loads(line.strip())["text"] == ESCAPES  # the JSON line stays exact (\u escapes)


def test_the_ui_shows_no_escape(monkeypatch) -> None:
    from specchat.app.tui.screens.dialogs import DiffScreen
    from specchat.app.tui.widgets.message_view import AssistantMessage, UserMessage, render_tokens
    from specchat.backend.api import TokenSource

    reply = AssistantMessage(header="pair", text=ESCAPES)
    reply.append(ESCAPES, [(ESCAPES, TokenSource.TARGET)])
    user = UserMessage(ESCAPES, ESCAPES)
    diff = DiffScreen([(ESCAPES, "+" + ESCAPES + "\n")], [ESCAPES])
    shown = [reply.text, user.display_text, render_tokens(reply.tokens).plain, *diff.sections[0], *diff.notes]
    for text in shown:
        assert not CONTROL.search(text.replace("\n", "")), repr(text)
    assert user.content == ESCAPES  # what is sent to the model is what was typed


@pytest.mark.parametrize("field", ["message", "title"])
def test_notifications_show_no_escape(field) -> None:
    from specchat.app.tui.app import SpecchatApp

    seen = {}

    def record(self, message, *, title="", severity="information", timeout=None, markup=False):
        seen.update(message=message, title=title)

    app = SpecchatApp.__new__(SpecchatApp)
    monkey = pytest.MonkeyPatch()
    monkey.setattr("textual.app.App.notify", record)
    try:
        SpecchatApp.notify(app, **{"message": "m", field: ESCAPES})
    finally:
        monkey.undo()
    assert not CONTROL.search(seen[field]), repr(seen[field])
