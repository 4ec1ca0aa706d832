"""/edit as one transaction over several files (issue 37): a block goes to the file its name means by path (a
name with spaces, the same name in two folders), bad replies over odd file layouts never write half an edit nor
leave a file beside the user's, and ``kill -9`` at any moment of a multi-file apply is completed (or taken back)
at the next start with /undo still possible. The counts go to the reliability summary."""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import FUZZED, KILLS, READINGS, SCALES, SURVIVED

from specchat.app.chat import edit_journal
from specchat.app.chat.edit_files import apply_plan, recover_edits, undo_edit
from specchat.app.chat.edit_plan import plan_edit
from specchat.app.chat.editing import EditError, build_edit_prompt, load_edit_target


def block(name: str, search: str, replace: str) -> str:
    return f"{name}\n<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


def test_a_block_for_a_name_with_spaces_goes_to_that_file_only(tmp_path: Path) -> None:
    spaced, plain = tmp_path / "my file.py", tmp_path / "file.py"
    spaced.write_text("x = 1\n")
    plain.write_text("x = 1\n")
    targets = [load_edit_target(plain), load_edit_target(spaced)]
    plan = plan_edit(targets, block("my file.py", "x = 1\n", "x = 2\n"))
    assert [c.target.path for c in plan.changes] == [spaced]
    wrong = plan_edit(targets[:1], block("my file.py", "x = 1\n", "x = 2\n"))  # not attached: never file.py
    assert not wrong.ok and "`my file.py`, which is not attached" in wrong.message()


def test_the_same_name_in_two_folders_needs_a_path(tmp_path: Path) -> None:
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "util.py").write_text("x = 1\n")
    targets = [load_edit_target(tmp_path / f / "util.py") for f in ("a", "b")]
    prompt = build_edit_prompt(targets, "set x to 2")
    assert "Current `a/util.py`" in prompt and "Current `b/util.py`" in prompt  # the reply can tell them apart
    vague = plan_edit(targets, block("util.py", "x = 1\n", "x = 2\n"))
    assert not vague.ok and "could be any of" in vague.message() and "Ask again" in vague.message()
    exact = plan_edit(targets, block("b/util.py", "x = 1\n", "x = 2\n"))
    assert [c.target.path for c in exact.changes] == [tmp_path / "b" / "util.py"]


# -- bad replies over odd layouts ----------------------------------------------------------------------------------
NAMES = ["a.py", "my file.py", "util.py", "sub/util.py", "ünï cödé.txt", "crlf.py", "mixed.py", "ro.py", "bom.py"]
CONTENT = {
    "crlf.py": b"x = 1\r\ny = 2\r\n",
    "mixed.py": b"x = 1\r\ny = 2\n",
    "bom.py": b"\xef\xbb\xbfx = 1\ny = 2\n",
}
LABELS = NAMES + ["file.py", "util", "sub/", "../a.py", "/abs/a.py", "Here is the change to a.py:", "", "a.py.bak"]
SEARCHES = ["x = 1\n", "y = 2\n", "x = 1\ny = 2\n", "", "nothing like it\n", "x = 1\n" * 2, "  x = 1\n"]


def _layout(root: Path, names: list[str]) -> dict[str, Path]:
    paths = {}
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(CONTENT.get(name, b"x = 1\ny = 2\n"))
        if name == "ro.py":
            os.chmod(path, 0o444)
        paths[name] = path
    return paths


reply_blocks = st.lists(
    st.tuples(st.sampled_from(LABELS), st.sampled_from(SEARCHES), st.sampled_from(["x = 9\n", "", "z = 3\n"])),
    min_size=1,
    max_size=4,
)
layouts = st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True)
garbage = st.sampled_from(
    ["", "<<<<<<< SEARCH\nx = 1\n", "=======\n", ">>>>>>> REPLACE\n", "```python\n", "```\n", "\x1b[31m", "\0"]
)


def test_bad_replies_over_odd_layouts_write_all_or_nothing(tmp_path_factory) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(layouts, reply_blocks, garbage)
    def run(names: list[str], blocks: list[tuple[str, str, str]], noise: str) -> None:
        FUZZED["/edit: bad replies and file layouts"] += 1
        root = tmp_path_factory.mktemp("layout")
        paths = _layout(root, names)
        before = {p: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode)) for p in paths.values()}
        old_cwd = os.getcwd()
        os.chdir(root)  # names as typed, relative to here
        try:
            targets = [load_edit_target(name) for name in names]
        finally:
            os.chdir(old_cwd)
        reply = "".join(block(label, search, replace) for label, search, replace in blocks) + noise
        plan = plan_edit(targets, reply, "change x")
        if not plan.ok:
            assert plan.refusals and "Nothing was written" in plan.message()
            assert {p: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode)) for p in paths.values()} == before
            return
        for change in plan.changes:  # each block went to the file its name means, or the one attached
            named = [b[0] for b in blocks if (root / b[0]).resolve() == change.target.path]
            assert named or len(targets) == 1 or any(b[0] == change.target.path.name for b in blocks)
        try:
            applied = apply_plan(plan)
        except EditError:  # a read-only file: refused before anything was written
            assert {p: p.read_bytes() for p in paths.values()} == {p: b for p, (b, _) in before.items()}
            return
        changed = {f.path for f in applied.files}
        for path, (data, mode) in before.items():
            assert stat.S_IMODE(path.stat().st_mode) == mode  # permissions kept
            if path not in changed:
                assert path.read_bytes() == data
            elif b"\r\n" in data and b"\n" not in data.replace(b"\r\n", b""):
                assert b"\n" not in path.read_bytes().replace(b"\r\n", b"")  # a CRLF file stays CRLF
        assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == sorted(names)
        undo_edit(applied)
        assert {p: p.read_bytes() for p in paths.values()} == {p: b for p, (b, _) in before.items()}
        assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == sorted(names)

    run()


# -- kill -9 during multi-file applies ---------------------------------------------------------------------------
# The child says where it is after the journal is in place and after each file is written, and lingers 20 ms
# there, so that the parent's kill lands at every stage (before the journal, between two files, after the last
# one) instead of only before or after the whole apply, which is what a blind random delay mostly hits.
CHILD = textwrap.dedent("""
    import sys, time
    from specchat.app.chat import edit_journal
    from specchat.app.chat.edit_files import apply_plan
    from specchat.app.chat.edit_plan import EditPlan, FileChange
    from specchat.app.chat.editing import load_edit_target

    def said(name, real):
        def wrapped(*args):
            result = real(*args)
            print(name, flush=True)
            time.sleep(0.02)
            return result
        return wrapped

    edit_journal.begin = said("begun", edit_journal.begin)
    edit_journal.put = said("put", edit_journal.put)
    paths = sys.argv[1:]
    targets = [load_edit_target(p) for p in paths]
    plan = EditPlan(changes=tuple(FileChange(t, t.text.replace("old", "NEW"), "whole file") for t in targets))
    print("go", flush=True)
    apply_plan(plan)
    print("applied", flush=True)
""")


def kill_during_multi_file_applies(tmp_path: Path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    outcomes = {"old": 0, "new": 0, "completed at the next start": 0, "half-applied when killed": 0}
    for round_ in range(kills):
        root = tmp_path / f"round{round_}"
        root.mkdir()
        paths = [root / f"f{i}.txt" for i in range(rng.randint(2, 4))]
        old = {p: (f"{p.name} old line\r\n" * 4000).encode() for p in paths}  # ~70 KB each, CRLF
        new = {p: data.replace(b"old", b"NEW") for p, data in old.items()}
        for path in paths:
            path.write_bytes(old[path])
            os.chmod(path, 0o640)
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, *map(str, paths)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        assert child.stdout is not None and child.stdout.readline() == b"go\n"
        for _ in range(rng.randint(0, len(paths) + 1)):  # past the journal and some of the files
            assert child.stdout.readline() in (b"begun\n", b"put\n")
        time.sleep(rng.uniform(0.0, 0.025))
        os.kill(child.pid, signal.SIGKILL)
        child.communicate()
        KILLS["multi-file /edit apply"] += 1
        killed = {p.read_bytes() == new[p] for p in paths}
        outcomes["half-applied when killed"] += killed == {True, False}  # what the next start must heal
        edits, notes = recover_edits()  # the next start
        outcomes["completed at the next start"] += sum("is now complete" in n for n in notes)
        state = {p: p.read_bytes() for p in paths}
        assert all(state[p] == old[p] for p in paths) or all(state[p] == new[p] for p in paths), notes
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o640 for p in paths)
        assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in paths)  # nothing left beside
        assert not list(edit_journal.edits_dir().glob(".*.tmp"))
        if state[paths[0]] == new[paths[0]]:
            outcomes["new"] += 1
            (edit,) = [e for e in edits if {f.path for f in e.files} == set(paths)]
            undo_edit(edit)  # /undo is still possible after the crash
            assert all(p.read_bytes() == old[p] for p in paths)
        else:
            outcomes["old"] += 1
        SURVIVED["multi-file /edit apply"] += 1
    READINGS[f"multi-file /edit kills ({kills})"] = ", ".join(f"{k} {v}" for k, v in outcomes.items())
    # the kills landed before the journal, after the whole apply and in between
    assert outcomes["old"] and outcomes["new"] and outcomes["completed at the next start"] or kills < 10, outcomes


@SCALES
def test_kill_9_during_a_multi_file_apply(tmp_path: Path, scale: int) -> None:
    kill_during_multi_file_applies(tmp_path, kills=5 * scale, seed=scale)
