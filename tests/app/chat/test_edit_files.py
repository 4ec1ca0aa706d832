"""Writing an /edit (app/chat/edit_files.py): /undo restores every file byte for byte; several files are written
all or none; a backup is never partial; a fuzz with failures injected at every write call leaves each file
old or new; and ``kill -9`` at random moments of an apply leaves the file old or new, never partial (10 kills
by default, 100 under ``pytest -m soak``)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.app.chat import edit_journal
from specchat.app.chat.edit_files import apply_plan, git_diff, recover_edits, undo_edit
from specchat.app.chat.edit_plan import EditPlan, FileChange, plan_edit
from specchat.app.chat.editing import EditError, load_edit_target

CALC = "def add(a, b):\r\n    return a + b\n\n\ndef sub(a, b):\r\n    return a - b\n"  # mixed line ends, on purpose


def change(path: Path, text: str) -> FileChange:
    return FileChange(load_edit_target(path), text, "whole file")


def test_undo_restores_every_file_byte_for_byte(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.txt"
    a.write_bytes(b"\xef\xbb\xbf" + CALC.encode())  # a BOM and mixed line ends
    b.write_bytes(b"no final newline")
    before = {p: p.read_bytes() for p in (a, b)}
    os.chmod(b, 0o640)
    applied = apply_plan(EditPlan(changes=(change(a, "x = 1\n"), change(b, "other"))))
    assert a.read_bytes() == b"\xef\xbb\xbfx = 1\r\n" and b.read_bytes() == b"other"
    assert [f.backup.read_bytes() for f in applied.files] == [before[a], before[b]]
    assert undo_edit(applied) == [a, b]
    assert {p: p.read_bytes() for p in (a, b)} == before and oct(b.stat().st_mode & 0o777) == "0o640"
    assert sorted(tmp_path.iterdir()) == [a, b]  # nothing beside the files: the journal held the originals


def test_undo_refuses_a_file_changed_since_the_edit(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text(CALC)
    applied = apply_plan(EditPlan(changes=(change(a, "x = 1\n"),)))
    a.write_text("edited by hand\n")
    with pytest.raises(EditError, match=r"/undo: .*a\.py changed since the edit was applied.*Nothing was restored"):
        undo_edit(applied)
    assert a.read_text() == "edited by hand\n"


def test_several_files_are_checked_before_any_is_written(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("a = 1\n")
    b.write_text("b = 1\n")
    plan = EditPlan(changes=(change(a, "a = 2\n"), change(b, "b = 2\n")))
    b.write_text("b changed meanwhile\n")
    with pytest.raises(EditError, match=r"b\.py changed on disk since it was attached"):
        apply_plan(plan)
    assert a.read_text() == "a = 1\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "b.py"]


def test_a_failure_on_the_second_file_puts_the_first_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("a = 1\n")
    b.write_text("b = 1\n")
    plan = EditPlan(changes=(change(a, "a = 2\n"), change(b, "b = 2\n")))
    real_replace = os.replace

    def full_disk_for_b(src, dst):
        if Path(dst) == b:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr("os.replace", full_disk_for_b)
    with pytest.raises(EditError) as error:
        apply_plan(plan)
    assert "could not write" in str(error.value) and "The files written before it were put back." in str(error.value)
    assert a.read_text() == "a = 1\n" and b.read_text() == "b = 1\n"


def test_a_refused_plan_writes_nothing(tmp_path: Path) -> None:
    a = tmp_path / "calc.py"
    a.write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n")
    plan = plan_edit([load_edit_target(a)], "```python\ndef sub(a, b):\n    return 0\n```", "fix sub")
    with pytest.raises(EditError, match="drops add"):
        apply_plan(plan)
    assert [p.name for p in tmp_path.iterdir()] == ["calc.py"]


def test_nothing_is_left_beside_the_files_and_a_second_undo_finds_nothing(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text("a = 1\n")
    applied = apply_plan(EditPlan(changes=(change(a, "a = 2\n"),)))
    assert applied.files[0].backup.read_text() == "a = 1\n" and [p.name for p in tmp_path.iterdir()] == ["a.py"]
    undo_edit(applied)
    assert a.read_text() == "a = 1\n" and [p.name for p in tmp_path.iterdir()] == ["a.py"]
    assert not list(edit_journal.edits_dir().iterdir())  # an undone edit leaves no journal either
    with pytest.raises(EditError, match=r"/undo: the record of the edit of .*a\.py is gone"):
        undo_edit(applied)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_diff_of_a_tracked_file(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    a, loose = tmp_path / "a.py", tmp_path / "loose.py"
    a.write_text("a = 1\n")
    loose.write_text("b = 1\n")
    for args in (["init", "-q"], ["add", "a.py"], ["commit", "-qm", "start"]):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, env=env, capture_output=True)
    apply_plan(EditPlan(changes=(change(a, "a = 2\n"), change(loose, "b = 2\n"))))
    diff = git_diff(a)
    assert diff is not None and "-a = 1\n+a = 2\n" in diff and diff.startswith("diff --git a/a.py b/a.py")
    assert git_diff(loose) is None  # not tracked


# -- fuzz: failures injected at any write call ------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000), st.integers(0, 12))
def test_a_failed_apply_leaves_the_file_old_and_a_done_one_new(tmp_path_factory, old, new, fail_at) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "f.txt"
    # no NUL (a binary file is refused) and no CR (line ends are tested on their own above)
    old_text, new_text = (raw.decode("latin-1").replace("\0", ".").replace("\r", ".") for raw in (old, new))
    path.write_bytes(old_text.encode("utf-8"))
    target = load_edit_target(path)
    calls = [0]
    real_write = os.write

    def flaky_write(fd, data):
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError(5, "Input/output error")
        return real_write(fd, data[: max(1, len(data) // 2)])  # short writes too

    os.write = flaky_write  # not monkeypatch: hypothesis runs many examples in one test call
    try:
        apply_plan(EditPlan(changes=(FileChange(target, new_text, "whole file"),)))
        written = True
    except EditError:
        written = False
    finally:
        os.write = real_write
    assert path.read_bytes() == (new_text if written else old_text).encode("utf-8")
    leftovers = [p.name for p in folder.iterdir() if p != path]
    assert not leftovers  # no backup, temporary or staging file left beside it
    assert not [p for p in edit_journal.edits_dir().glob(".*.tmp")]  # nor a half-written journal


# -- kill -9 at random moments of an apply ------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys
    from specchat.app.chat.edit_files import apply_plan
    from specchat.app.chat.edit_plan import EditPlan, FileChange
    from specchat.app.chat.editing import load_edit_target
    path, texts = sys.argv[1], [sys.argv[2] * 20000, sys.argv[3] * 20000]
    print("ready", flush=True)
    while True:
        target = load_edit_target(path)
        new = texts[1] if target.text == texts[0] else texts[0]
        apply_plan(EditPlan(changes=(FileChange(target, new, "whole file"),)))
        print("applied", flush=True)
""")


def kill_during_applies(tmp_path: Path, kills: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    path = tmp_path / "big.txt"
    a, b = "alpha line\n", "BETA LINE!\n"
    versions = {(a * 20000).encode(), (b * 20000).encode()}  # 220 KB, under the 256 KiB /edit limit
    path.write_bytes((a * 20000).encode())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    applies, seen = 0, set()
    for _ in range(kills):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), a, b], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        assert not err, err.decode()  # it was applying edits when killed, not failing
        applies += out.count(b"applied\n")
        content = path.read_bytes()
        assert content in versions  # the old content or the new one, never a part
        seen.add(content)
        recover_edits()  # the next start: completes the interrupted edit, removes the killed write's temporary
        assert path.read_bytes() == content or path.read_bytes() in versions
        assert [p.name for p in tmp_path.iterdir()] == ["big.txt"]
        seen.add(path.read_bytes())
    assert applies >= kills and seen == versions  # the kills landed among many applies, both ways


def test_kill_9_during_an_apply_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    kill_during_applies(tmp_path, kills=10)


@pytest.mark.soak
def test_kill_9_during_an_apply_soak(tmp_path: Path) -> None:
    kill_during_applies(tmp_path, kills=100, seed=1)
