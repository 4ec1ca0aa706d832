"""`/edit` and `/file` (app/chat/editing.py, edit_plan.py, edit_files.py): every refused input says which file
and what to do; prompts, code block extraction (with a hypothesis robustness check), diffs, and apply with
backup / refusal on a file that changed on disk; path safety (NUL bytes, symlinks, mixed line ends)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.app.chat import edit_journal, editing
from specchat.app.chat.edit_files import apply_edit
from specchat.app.chat.edit_plan import unified_diff
from specchat.app.chat.editing import (
    MAX_FILE_BYTES,
    EditError,
    build_edit_prompt,
    build_file_context,
    check_writable,
    code_blocks,
    edit_prediction,
    extract_code_block,
    load_edit_target,
)
from specchat.backend.errors import SpecchatError

PY = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def py_file(tmp_path: Path) -> Path:
    f = tmp_path / "calc.py"
    f.write_text(PY)
    return f


# -- bad input ------------------------------------------------------------------------------------------------
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(EditError) as err:
        load_edit_target(tmp_path / "nope.py")
    msg = str(err.value)
    assert msg.startswith(f"/edit {tmp_path / 'nope.py'}: no such file")
    assert "Check the path" in msg and "relative paths start from" in msg
    assert isinstance(err.value, SpecchatError)


def test_directory(tmp_path: Path) -> None:
    folder = re.escape(str(tmp_path))
    with pytest.raises(EditError, match=rf"{folder} is a folder, not a file\. Name one file inside it"):
        load_edit_target(tmp_path)


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(EditError, match=r"pipe is not a regular file .*Name a text file"):
        load_edit_target(fifo)


def test_symlink_loop(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(EditError, match=r"^/edit .*a: cannot open .*Check the path"):
        load_edit_target(tmp_path / "a")


def test_binary_file(tmp_path: Path) -> None:
    f = tmp_path / "image.png"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(EditError, match=rf"{re.escape(str(f))} looks like a binary file \(it contains NUL bytes\)"):
        load_edit_target(f)


def test_not_utf8(tmp_path: Path) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    expected = rf"{re.escape(str(f))} is not UTF-8 text \(invalid byte at offset 3\).*Convert it to UTF-8"
    with pytest.raises(EditError, match=expected):
        load_edit_target(f)


def test_huge_file_names_the_limit_and_the_size(tmp_path: Path) -> None:
    f = tmp_path / "big.py"
    f.write_text("x = 1\n" * 60_000)  # 360000 bytes
    with pytest.raises(EditError) as err:
        load_edit_target(f)
    msg = str(err.value)
    assert str(f) in msg and "(360000 bytes)" in msg and "352 KiB" in msg
    assert "up to 256 KiB" in msg and "Attach a smaller file" in msg
    f.write_text("x" * MAX_FILE_BYTES)  # exactly at the limit is accepted
    assert len(load_edit_target(f).text) == MAX_FILE_BYTES


def test_file_context_uses_the_same_checks(tmp_path: Path) -> None:
    with pytest.raises(EditError, match=r"^/file .*missing\.md: no such file"):
        build_file_context(tmp_path / "missing.md")


def test_empty_request_is_refused(py_file: Path) -> None:
    expected = rf"say what to change after the path, e\.g\. /edit {re.escape(str(py_file))} add type hints"
    with pytest.raises(EditError, match=expected):
        build_edit_prompt(load_edit_target(py_file), "   ")


# As root, chmod stops neither reads nor writes: those checks run in a forked child that drops to "nobody".
# (A fork, not a new interpreter: the interpreter may live under a folder "nobody" cannot enter.)
def _as_other_user(path: Path, apply: bool = False) -> str:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            target = load_edit_target(path)
            check_writable(target)
            if apply:
                apply_edit(target, "changed\n")
            result = "OK"
        except EditError as exc:
            result = f"EditError: {exc}"
        except BaseException as exc:  # reported to the test, which fails on it
            result = f"{type(exc).__name__}: {exc}"
        os.write(write_end, result.encode())
        os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


@pytest.fixture
def shared_dir():
    """A folder "nobody" can enter and write (pytest's tmp_path parents are root-only)."""
    d = Path(tempfile.mkdtemp(prefix="specchat-edit-"))
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d)


def test_unreadable_file(shared_dir: Path) -> None:
    f = shared_dir / "secret.py"
    f.write_text(PY)
    os.chmod(f, 0o000)
    expected = f"EditError: /edit {f}: cannot read {f}: permission denied. Make it readable (chmod u+r {f})."
    assert _as_other_user(f) == expected


def test_unwritable_file_is_reported_before_the_model_runs(shared_dir: Path) -> None:
    f = shared_dir / "readonly.py"
    f.write_text(PY)
    os.chmod(f, 0o444)
    msg = _as_other_user(f)
    assert msg.startswith(f"EditError: /edit {f}: {f} is read-only for you, so an edit could not be saved.")
    assert f"chmod u+w {f}" in msg
    assert _as_other_user(f, apply=True).startswith(f"EditError: /edit {f}: {f} is read-only")
    assert f.read_text() == PY and [p.name for p in shared_dir.iterdir()] == ["readonly.py"]


def test_unwritable_folder(shared_dir: Path) -> None:
    folder = shared_dir / "locked"
    folder.mkdir()
    f = folder / "x.py"
    f.write_text(PY)
    os.chmod(f, 0o666)
    os.chmod(folder, 0o555)
    try:
        msg = _as_other_user(f)
    finally:
        os.chmod(folder, 0o755)
    assert msg.startswith(f"EditError: /edit {f}: its folder {folder} is not writable")
    assert "Make the folder writable" in msg


def test_writable_file_passes(py_file: Path) -> None:
    check_writable(load_edit_target(py_file))


# -- prompts --------------------------------------------------------------------------------------------------
def test_edit_prompt_asks_for_search_replace_blocks_and_carries_the_whole_file(py_file: Path, monkeypatch) -> None:
    monkeypatch.setattr(editing, "REWRITE_MAX_BYTES", len(PY.encode()) - 1)  # a file above the whole-rewrite size
    assert edit_prediction([load_edit_target(py_file)]) is None
    prompt = build_edit_prompt(load_edit_target(py_file), "add type hints")
    assert "Request: add type hints" in prompt
    assert f"```python\n{PY}```\n" in prompt
    assert "calc.py\n<<<<<<< SEARCH\n" in prompt and "\n=======\n" in prompt and "\n>>>>>>> REPLACE\n" in prompt
    assert "Copy the SEARCH lines character for character" in prompt


def test_a_small_file_is_asked_for_whole_and_predicted_to_be_itself(py_file: Path, monkeypatch) -> None:
    """Up to REWRITE_MAX_BYTES (here exactly the file's size) the whole changed file is asked for, and the reply is
    predicted to be the file in the prompt's fence (the engine drafts from it); several files get blocks."""
    monkeypatch.setattr(editing, "REWRITE_MAX_BYTES", len(PY.encode()))
    target = load_edit_target(py_file)
    prompt = build_edit_prompt(target, "add type hints")
    assert "Answer with the whole new file in one python code block" in prompt and "SEARCH" not in prompt
    assert f"```python\n{PY}```\n" in prompt and "Request: add type hints" in prompt
    assert edit_prediction([target]) == f"```python\n{PY}```"
    assert edit_prediction([target, target]) is None


def test_edit_prompt_for_several_files(tmp_path: Path, py_file: Path) -> None:
    other = tmp_path / "util.py"
    other.write_text("X = 1\n")
    prompt = build_edit_prompt([load_edit_target(py_file), load_edit_target(other)], "rename add")
    assert "Edit the files below" in prompt and "Current `calc.py`" in prompt and "Current `util.py`" in prompt


def test_prompt_fence_outlasts_fences_inside_the_file(tmp_path: Path) -> None:
    f = tmp_path / "README.md"
    f.write_text("# Doc\n\n```bash\nls\n```\n")
    prompt = build_edit_prompt(load_edit_target(f), "fix typos")
    assert "````markdown\n# Doc\n\n```bash\nls\n```\n````\n" in prompt
    # The model echoing that layout back extracts the whole file, inner fence included.
    assert extract_code_block(prompt) == f.read_text()


def test_file_context(tmp_path: Path) -> None:
    f = tmp_path / "Makefile"
    f.write_text("all:\n\techo hi")  # no final newline
    ctx = build_file_context(f)
    assert ctx == "Here is the file `Makefile` for reference (read-only):\n```make\nall:\n\techo hi\n```\n"


# -- code block extraction ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Sure:\n```python\nx = 1\n```\nDone.", "x = 1\n"),
        ("~~~py\nx = 1\n~~~", "x = 1\n"),
        ("```\nno tag\n```", "no tag\n"),
        ('```python title="a.py"\nx\n```', "x\n"),
        ("small:\n```\na\n```\nwhole file:\n```py\na\nb\nc\n```\nnote:\n```\nz\n```", "a\nb\nc\n"),  # largest
        ("```\nfirst\n```\n```\nlast!\n```", "last!\n"),  # equal size: the last
        ("Here it is:\n```python\ndef f():\n    return 1\n", "def f():\n    return 1\n"),  # partial reply
        ("```python\ndef f():\n    ret", "def f():\n    ret\n"),  # cut mid-line
        ("````md\n```py\ninner\n```\n````", "```py\ninner\n```\n"),  # a longer fence holds a shorter one
        ("```\na\n`````\n", "a\n"),  # a closing fence may be longer
        ("~~~\na\n```\nb\n~~~", "a\n```\nb\n"),  # a backtick line does not close a tilde fence
        ("  ```\n  indented\n    more\n  ```", "indented\n  more\n"),  # the fence's indent is removed
        ("inline ```code``` is not a fence", None),
        ("no code at all", None),
        ("    ```\n    indented four spaces is code, not a fence\n    ```", None),
        ("```\r\nwindows\r\n```\r\n", "windows\n"),
        ("```\n```", ""),
    ],
)
def test_extract_code_block(reply: str, expected: str | None) -> None:
    assert extract_code_block(reply) == expected


def test_code_blocks_report_language_and_closure() -> None:
    blocks = code_blocks("```python\na\n```\ntext\n~~~ rust extra\nb\n")
    assert [(b.language, b.text, b.closed) for b in blocks] == [("python", "a\n", True), ("rust", "b\n", False)]


def test_extract_prefers_the_file_language() -> None:
    reply = "```python\nshort\n```\n```bash\nrun this long command line\n```"
    assert extract_code_block(reply, language="python") == "short\n"
    assert extract_code_block(reply, language="go") == "run this long command line\n"  # none tagged: largest


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("`~ \n\t\rax{}#") + ["```", "~~~", "````", "\n```py\n"]), max_size=80))
def test_extract_never_raises_on_fence_heavy_text(pieces: list[str]) -> None:
    result = extract_code_block("".join(pieces))
    assert result is None or isinstance(result, str)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_extract_never_raises_on_any_text(reply: str) -> None:
    result = extract_code_block(reply, language="python")
    assert result is None or isinstance(result, str)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.text(alphabet=st.characters(blacklist_characters="`~\r\n", blacklist_categories=("Cs",)), max_size=40),
        max_size=20,
    ),
    st.text(alphabet=st.characters(blacklist_characters="`~\r\n", blacklist_categories=("Cs",)), max_size=40),
)
def test_extract_returns_the_file_the_model_wrote(lines: list[str], prose: str) -> None:
    body = "".join(f"{line}\n" for line in lines)
    assert extract_code_block(f"{prose}\n```python\n{body}```\n{prose}") == body


# -- diff and apply -------------------------------------------------------------------------------------------
NEW_PY = "def add(a: int, b: int) -> int:\n    return a + b\n"


def test_unified_diff(py_file: Path) -> None:
    target = load_edit_target(py_file)
    diff = unified_diff(target, NEW_PY)
    assert str(py_file).startswith("/")  # an absolute path: "a/" + the path without its "/" (was "a//tmp/...")
    assert diff.startswith(f"--- a{py_file}\n+++ b{py_file}\n@@ ")
    assert "-def add(a, b):\n+def add(a: int, b: int) -> int:\n     return a + b\n" in diff
    assert unified_diff(target, PY) == ""


def test_diff_marks_a_missing_final_newline(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("one\ntwo")
    diff = unified_diff(load_edit_target(f), "one\nthree")  # the plan keeps the file's missing final newline
    assert diff.endswith("-two\n\\ No newline at end of file\n+three\n\\ No newline at end of file\n")


def test_apply_writes_only_the_file_and_keeps_the_original_in_its_journal(py_file: Path) -> None:
    os.chmod(py_file, 0o640)
    target = load_edit_target(py_file)
    original = apply_edit(target, NEW_PY)
    assert py_file.read_text() == NEW_PY
    assert original.parent.parent == edit_journal.edits_dir() and original.read_text() == PY
    assert stat.S_IMODE(py_file.stat().st_mode) == 0o640
    assert [p.name for p in py_file.parent.iterdir()] == ["calc.py"]  # no backup, no temporary file beside it

    again = apply_edit(load_edit_target(py_file), "x = 1\n")  # a second edit in the same second
    assert again != original and again.read_text() == NEW_PY and original.read_text() == PY
    assert py_file.read_text() == "x = 1\n"


def test_apply_that_cannot_write_leaves_the_file_and_nothing_beside_it(
    py_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = load_edit_target(py_file)
    journals = edit_journal.edits_dir()

    real_replace = os.replace

    def boom(src, dst):  # the journal is written; replacing the file itself fails
        if Path(dst) == py_file:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(EditError) as err:
        apply_edit(target, NEW_PY)
    monkeypatch.undo()
    assert f"/edit {py_file}: could not write {py_file}: No space left on device. The file is unchanged." in str(
        err.value
    )
    assert py_file.read_text() == PY
    assert [p.name for p in py_file.parent.iterdir()] == ["calc.py"]
    assert not list(journals.iterdir())  # the journal of the failed edit is gone too


def test_apply_refuses_a_file_changed_since_it_was_loaded(py_file: Path) -> None:
    target = load_edit_target(py_file)
    py_file.write_text("# edited in another editor\n")
    with pytest.raises(EditError) as err:
        apply_edit(target, NEW_PY)
    msg = str(err.value)
    assert f"{py_file} changed on disk since it was attached" in msg
    assert f"Nothing was written: run /edit {py_file} again" in msg
    assert py_file.read_text() == "# edited in another editor\n"
    assert [p.name for p in py_file.parent.iterdir()] == ["calc.py"]  # no backup either


def test_apply_refuses_a_deleted_file(py_file: Path) -> None:
    target = load_edit_target(py_file)
    py_file.unlink()
    with pytest.raises(EditError, match=r"cannot read .*calc\.py again before saving.*Nothing was written"):
        apply_edit(target, NEW_PY)
    assert not py_file.exists()


def test_apply_refuses_text_that_cannot_be_saved(py_file: Path) -> None:
    with pytest.raises(EditError, match=r"cannot be saved as UTF-8 .*Nothing was written"):
        apply_edit(load_edit_target(py_file), "bad \udc80 surrogate\n")
    assert py_file.read_text() == PY and [p.name for p in py_file.parent.iterdir()] == ["calc.py"]


def test_apply_keeps_crlf_bom_and_missing_final_newline(tmp_path: Path) -> None:
    f = tmp_path / "win.txt"
    f.write_bytes(b"\xef\xbb\xbfone\r\ntwo")
    target = load_edit_target(f)
    assert (target.text, target.encoding, target.newline) == ("one\ntwo", "utf-8-sig", "\r\n")
    apply_edit(target, "one\n2\n")
    assert f.read_bytes() == b"\xef\xbb\xbfone\r\n2"


def test_apply_through_a_symlink_edits_the_real_file(tmp_path: Path, py_file: Path) -> None:
    link = tmp_path / "link.py"
    link.symlink_to(py_file)
    target = load_edit_target(link)
    assert target.path == py_file and target.display == str(link)
    backup = apply_edit(target, NEW_PY)
    assert link.is_symlink() and py_file.read_text() == NEW_PY and backup.read_text() == PY


# -- path safety (issue 20, item 10) -----------------------------------------------------------------------------
def test_a_path_with_a_nul_byte_is_refused_with_an_edit_error(tmp_path: Path) -> None:
    with pytest.raises(EditError, match=r"the path contains a NUL byte"):
        load_edit_target(f"{tmp_path}/calc\0.py")
    with pytest.raises(EditError, match=r"^/file .*NUL byte"):
        build_file_context("notes\0.txt")


def test_mixed_line_ends_are_kept_line_by_line(tmp_path: Path) -> None:
    f = tmp_path / "mixed.txt"
    f.write_bytes(b"one\r\ntwo\nthree\r\nfour\nfive")
    target = load_edit_target(f)
    assert target.mixed_newlines and target.text == "one\ntwo\nthree\nfour\nfive"
    assert unified_diff(target, "one\ntwo\nTHREE\nfour\nfive") == (
        f"--- a{f}\n+++ b{f}\n@@ -1,5 +1,5 @@\n one\n two\n-three\n+THREE\n four\n five\n\\ No newline at end of file\n"
    )
    apply_edit(target, "one\ntwo\nTHREE\nfour\nnew\nfive")
    assert f.read_bytes() == b"one\r\ntwo\nTHREE\r\nfour\nnew\r\nfive"  # unchanged lines keep their own end


def test_a_crlf_file_stays_crlf_and_an_lf_file_lf(tmp_path: Path) -> None:
    crlf, lf = tmp_path / "crlf.txt", tmp_path / "lf.txt"
    crlf.write_bytes(b"a\r\nb\r\n")
    lf.write_bytes(b"a\nb\n")
    apply_edit(load_edit_target(crlf), "a\nB\nc\n")
    apply_edit(load_edit_target(lf), "a\nB\nc\n")
    assert crlf.read_bytes() == b"a\r\nB\r\nc\r\n" and lf.read_bytes() == b"a\nB\nc\n"


def test_a_symlink_is_named_with_its_real_target(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    real = outside / "real.py"
    real.write_text(PY)
    project = tmp_path / "project"
    project.mkdir()
    (project / "link.py").symlink_to(real)
    target = load_edit_target(project / "link.py")
    assert target.path == real and target.link == str(project / "link.py")
    assert load_edit_target(real).link == ""
