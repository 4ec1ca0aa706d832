"""Pilot tests of /edit (diff shown, applied only after confirmation, backup kept, refusals, /undo, several
files, symlinks) and /file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from app_harness import make_app, notifications, ready, reply_done, screen_text, send, wait_for
from fake_engine import FakeEngineFactory
from textual.widgets import Static

from specchat.app.tui.screens.commands import split_path_argument
from specchat.app.tui.screens.dialogs import DiffScreen
from specchat.app.tui.widgets.edit_note import EditNote
from specchat.app.tui.widgets.message_view import UserMessage

ORIGINAL = "def answer():\n    return 1\n"
EDITED_REPLY = "Here you go:\n\n```python\ndef answer():\n    return 42\n```\n\nI changed the value.\n"


def edit_app(tmp_path):
    return make_app(tmp_path, factory=FakeEngineFactory(reply=EDITED_REPLY))


async def test_edit_shows_a_diff_and_applies_after_confirmation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "answer.py").write_text(ORIGINAL)
    app = edit_app(tmp_path)
    async with app.run_test(size=(120, 45)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit answer.py")
        chip = app.chat.query_one("#attachments", Static)
        assert chip.display and "editing answer.py" in str(chip.render())
        await send(pilot, "return 42 instead")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), what="the diff")
        diff = app.screen.diff
        assert "-    return 1" in diff and "+    return 42" in diff
        content = app.engine.requests[0].messages[-1]["content"]
        assert "return 42 instead" in content and ORIGINAL in content
        shown = app.chat.query_one(UserMessage).display_text
        assert "edit answer.py" in shown and "return 42 instead" in shown and "def answer" not in shown
        await pilot.press("a")
        await wait_for(pilot, lambda: (tmp_path / "answer.py").read_text() != ORIGINAL)
        assert (tmp_path / "answer.py").read_text() == "def answer():\n    return 42\n"
        assert not _left_beside(tmp_path)  # no backup beside it: the journal has it
        assert app.chat.edits.applied[-1].files[0].backup.read_text() == ORIGINAL
        assert any("Edit applied" in n for n in notifications(app))
        assert not chip.display


def _left_beside(folder) -> list:
    """Backup, staging or temporary files an edit left in the user's folder."""
    return [p.name for p in folder.iterdir() if "specchat-bak" in p.name or p.name.endswith(".tmp")]


async def test_a_small_file_is_rewritten_whole_with_itself_as_prediction(tmp_path, monkeypatch):
    """Issue 35: the prompt asks for the whole file, the request predicts the reply to be the file (the engine drafts
    from it), the live and final stats lines show the prediction's accepted and rejected tokens, the whole-file
    reply is still checked and shown as a diff, applied on confirmation and taken back by /undo."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "answer.py").write_text(ORIGINAL)
    app = edit_app(tmp_path)
    async with app.run_test(size=(140, 45)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit answer.py return 42 instead")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), what="the diff")
        request = app.engine.requests[0]
        assert request.prediction == f"```python\n{ORIGINAL}```"
        assert "Answer with the whole new file" in request.messages[-1]["content"]
        assert "+    return 42" in app.screen.diff
        assert any("whole new answer.py" in note for note in app.screen.notes)
        await pilot.press("a")
        await wait_for(pilot, lambda: (tmp_path / "answer.py").read_text() != ORIGINAL)
        assert re.search(r"prediction \d+ ✓ \d+ ✗", screen_text(app)), screen_text(app)
        await send(pilot, "/undo")
        assert (tmp_path / "answer.py").read_text() == ORIGINAL


async def test_edit_cancelled_leaves_the_file_and_can_be_reviewed_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "answer.py").write_text(ORIGINAL)
    app = edit_app(tmp_path)
    async with app.run_test(size=(120, 45)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit answer.py return 42 instead")  # the request after the path: sent at once
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, DiffScreen))
        assert (tmp_path / "answer.py").read_text() == ORIGINAL and not _left_beside(tmp_path)
        app.chat.action_review_edit()
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen))
        await pilot.click("#apply")
        await wait_for(pilot, lambda: (tmp_path / "answer.py").read_text() != ORIGINAL)


async def test_file_context_and_attachment_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("the secret word is banana\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit missing.py")
        assert "no such file" in notifications(app)[-1]
        assert app.chat.query_one("#prompt").text == "/edit missing.py"  # kept, to fix the path
        await send(pilot, "/file blob.bin")
        assert "binary" in notifications(app)[-1]
        await send(pilot, "/edit")
        assert "needs a file path" in notifications(app)[-1]
        assert not app.engine.requests
        assert split_path_argument('"my notes.txt" what is it?') == ("my notes.txt", "what is it?")
        assert split_path_argument("notes.txt what is it?") == ("notes.txt", "what is it?")
        (tmp_path / "with space.txt").write_text("x\n")
        assert split_path_argument("with space.txt") == ("with space.txt", "")
        await send(pilot, "/file notes.txt")
        assert "📎 notes.txt" in str(app.chat.query_one("#attachments", Static).render())
        await send(pilot, "what is the secret word?")
        await reply_done(pilot)
        content = app.engine.requests[0].messages[-1]["content"]
        assert "the secret word is banana" in content and content.endswith("what is the secret word?")
        assert not isinstance(app.screen, DiffScreen)  # /file never offers an edit
        stored = app.store.messages(app.chat.conv.chat_id)[0]
        assert stored.stats["attachments"] == ["notes.txt"] and stored.stats["request"] == "what is the secret word?"
        await send(pilot, "/file notes.txt")
        await send(pilot, "/drop")
        assert not app.chat.query_one("#attachments", Static).display


# -- issue 19: edits that cannot destroy a file ------------------------------------------------------------------
CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FRAGMENT_REPLY = "Here is the updated function:\n\n```python\ndef sub(a: int, b: int) -> int:\n    return a - b\n```\n"
BLOCK_REPLY = (
    "calc.py\n```python\n<<<<<<< SEARCH\ndef sub(a, b):\n    return a - b\n=======\n"
    "def sub(a: int, b: int) -> int:\n    return a - b\n>>>>>>> REPLACE\n```\n"
)


async def test_a_reply_holding_only_the_changed_function_is_refused_and_the_file_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calc.py").write_text(CALC)
    app = make_app(tmp_path, factory=FakeEngineFactory(reply=FRAGMENT_REPLY))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit calc.py add type hints to sub")
        await wait_for(pilot, lambda: app.chat.query(EditNote), what="the refusal")
        note = app.chat.query_one(EditNote)
        assert note.kind == "refused" and "drops add, mul" in note.text and "Nothing was written" in note.text
        assert not isinstance(app.screen, DiffScreen)
        assert (tmp_path / "calc.py").read_text() == CALC and not _left_beside(tmp_path)
        assert any("/edit refused" in n for n in notifications(app))


async def test_search_replace_blocks_apply_exactly_and_undo_restores_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    original = CALC.replace("\n", "\r\n", 2).encode()  # mixed line ends: kept as they are
    (tmp_path / "calc.py").write_bytes(original)
    git = shutil.which("git")
    if git:
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        }
        for args in (["init", "-q"], ["add", "calc.py"], ["commit", "-qm", "start"]):
            subprocess.run([git, "-C", str(tmp_path), *args], check=True, env=env, capture_output=True)
    monkeypatch.setattr("specchat.app.chat.editing.REWRITE_MAX_BYTES", 0)  # blocks for any file
    app = make_app(tmp_path, factory=FakeEngineFactory(reply=BLOCK_REPLY))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit calc.py add type hints to sub")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), what="the diff")
        prompt = app.engine.requests[0].messages[-1]["content"]
        assert "<<<<<<< SEARCH" in prompt and CALC.replace("\n", "") in prompt.replace("\n", "").replace("\r", "")
        assert "-def sub(a, b):\n+def sub(a: int, b: int) -> int:\n" in app.screen.diff
        assert any("mixes CRLF and LF" in n for n in app.screen.notes)
        await pilot.press("a")
        await wait_for(pilot, lambda: any(n.kind == "applied" for n in app.chat.query(EditNote)))
        edited = original.replace(b"def sub(a, b):", b"def sub(a: int, b: int) -> int:")
        assert (tmp_path / "calc.py").read_bytes() == edited
        applied = [n for n in app.chat.query(EditNote) if n.kind == "applied"][0]
        assert "/undo takes it back" in applied.text
        if git:
            assert "git diff calc.py" in screen_text(app) and "+def sub(a: int, b: int) -> int:" in screen_text(app)
        await send(pilot, "/undo")
        assert (tmp_path / "calc.py").read_bytes() == original
        assert any(n.kind == "undone" for n in app.chat.query(EditNote))
        await send(pilot, "/undo")  # says what happened, not that nothing was ever applied
        assert "Nothing left to undo: the last /edit (calc.py) was undone already." in notifications(app)[-1]
        assert not [p for p in tmp_path.iterdir() if "specchat-bak" in p.name or p.name.endswith(".tmp")]


async def test_one_request_edits_several_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "use.py").write_text("from calc import add\n\nprint(add(1, 2))\n")
    reply = (
        "calc.py\n<<<<<<< SEARCH\ndef add(a, b):\n=======\ndef plus(a, b):\n>>>>>>> REPLACE\n\n"
        "use.py\n<<<<<<< SEARCH\nfrom calc import add\n\nprint(add(1, 2))\n=======\n"
        "from calc import plus\n\nprint(plus(1, 2))\n>>>>>>> REPLACE\n"
    )
    app = make_app(tmp_path, factory=FakeEngineFactory(reply=reply))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit calc.py use.py")
        assert "editing calc.py" in str(app.chat.query_one("#attachments", Static).render())
        await send(pilot, "rename add to plus")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), what="the diff")
        assert [heading for heading, _ in app.screen.sections] == ["calc.py", "use.py"]
        assert "Apply this edit to 2 files?" in screen_text(app)
        await pilot.press("a")
        await wait_for(pilot, lambda: "plus" in (tmp_path / "use.py").read_text())
        assert "def plus(a, b):" in (tmp_path / "calc.py").read_text()
        assert app.store.messages(app.chat.conv.chat_id)[0].stats["edit"] == [
            str(tmp_path / "calc.py"),
            str(tmp_path / "use.py"),
        ]


async def test_the_dialog_names_the_real_file_behind_a_symlink(tmp_path, monkeypatch):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (elsewhere / "calc.py").write_text(CALC)
    (project / "link.py").symlink_to(elsewhere / "calc.py")
    monkeypatch.chdir(project)
    app = make_app(tmp_path, factory=FakeEngineFactory(reply=BLOCK_REPLY.replace("calc.py\n", "link.py\n", 1)))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit link.py add type hints to sub")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), what="the diff")
        title = str(app.screen.query_one(".dialog-title").render())
        assert f"link.py → {elsewhere / 'calc.py'} (outside the current folder {project})" in title
        assert "(outside the current" in screen_text(app)  # wrapped, not cut
        assert any(f"the edit writes {elsewhere / 'calc.py'}" in n for n in app.screen.notes)
        await pilot.press("a")
        await wait_for(pilot, lambda: "a: int" in (elsewhere / "calc.py").read_text())
        assert (project / "link.py").is_symlink()


async def test_up_on_an_edit_request_attaches_the_file_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calc.py").write_text(CALC)
    app = make_app(tmp_path, factory=FakeEngineFactory(reply="I cannot."))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "/edit calc.py type hints pls")
        await reply_done(pilot)
        await wait_for(pilot, lambda: app.chat.query(EditNote))  # refused: no blocks, no code
        prompt = app.chat.query_one("#prompt")
        prompt.focus()
        await pilot.press("up")
        assert prompt.text == "type hints pls" and [t.path.name for t in app.chat.attachments.edits] == ["calc.py"]
        prompt.text = "add type hints to every function"
        await pilot.press("enter")
        await reply_done(pilot)
        assert len(app.chat.conv.turns) == 2
        assert "Request: add type hints to every function" in app.engine.requests[-1].messages[-1]["content"]


KILLED_MID_APPLY = """
import os, sys
from specchat.app.chat import edit_journal
from specchat.app.chat.edit_files import apply_plan
from specchat.app.chat.edit_plan import EditPlan, FileChange
from specchat.app.chat.editing import load_edit_target
real_put = edit_journal.put
def put(file, data):
    real_put(file, data)
    os._exit(0)  # gone after the first file, as a kill -9 would leave it
edit_journal.put = put
targets = [load_edit_target(p) for p in sys.argv[1:]]
apply_plan(EditPlan(changes=tuple(FileChange(t, t.text.replace("1", "2"), "whole file") for t in targets)))
"""


async def test_an_edit_killed_half_way_is_completed_at_start_and_can_be_undone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "one.py", tmp_path / "two.py"
    first.write_text("x = 1\n")
    second.write_text("y = 1\n")
    subprocess.run([sys.executable, "-c", KILLED_MID_APPLY, str(first), str(second)], check=True, timeout=60)
    assert (first.read_text(), second.read_text()) == ("x = 2\n", "y = 1\n")  # half-applied, as the kill left it
    app = edit_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: any("it is now complete" in n for n in notifications(app)))
        assert (first.read_text(), second.read_text()) == ("x = 2\n", "y = 2\n")
        await send(pilot, "/undo")
        assert (first.read_text(), second.read_text()) == ("x = 1\n", "y = 1\n")
        assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".py") == ["one.py", "two.py"]
