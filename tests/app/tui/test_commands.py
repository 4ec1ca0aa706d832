"""Units of the chat screen's parts: slash-command parsing and the user turn the attachments build."""

from __future__ import annotations

from specchat.app.chat.editing import load_edit_target
from specchat.app.tui.screens.commands import is_command, parse_command
from specchat.app.tui.widgets.attachments import AttachedFile, Attachments


def test_commands_parse_their_paths_and_the_request_on_the_same_or_the_next_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b c.py").write_text("y = 2\n")
    assert is_command("/edit a.py") and not is_command("//edit a.py") and not is_command("hello /edit")
    assert parse_command('/edit a.py "b c.py" rename x\nand y') == parse_command('/edit a.py "b c.py"\nrename x\nand y')
    command = parse_command('/edit a.py "b c.py" rename x\nand y')
    assert (command.name, command.paths, command.request) == ("/edit", ["a.py", "b c.py"], "rename x\nand y")
    assert parse_command("/file a.py what is x?").paths == ["a.py"]
    assert parse_command("/file").paths == [""] and parse_command("/edit").paths == []  # both: "needs a path"
    assert parse_command("/undo now") == parse_command("/undo")  # other commands take no argument


def test_the_user_turn_carries_the_attached_files_and_the_edit_request(tmp_path):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    attachments = Attachments()
    assert attachments.message_for("hi") == ("hi", {})
    attachments.files = [AttachedFile("notes.txt", "<notes>", "/abs/notes.txt")]
    attachments.edits = [load_edit_target(tmp_path / "calc.py")]
    content, meta = attachments.message_for("add type hints")
    assert content.startswith("<notes>\n\n") and "def add(a, b):" in content and "add type hints" in content
    assert meta == {
        "edit": [str(tmp_path / "calc.py")],
        "request": "add type hints",
        "attachments": ["notes.txt", attachments.edits[0].shown],
        "files": ["/abs/notes.txt"],
    }
    assert attachments.files and attachments.edits  # building the turn detaches nothing: sending does
