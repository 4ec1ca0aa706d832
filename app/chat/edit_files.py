"""Writing an accepted ``/edit`` to disk as one transaction, taking it back with ``/undo``, and showing git's view.

Contract:
- :func:`apply_plan` writes the files of an :class:`~specchat.app.chat.edit_plan.EditPlan` (only their real
  paths: a symlink stays a link to the file it names) after the user's confirmation. Before writing anything
  it checks every file: unchanged since it was attached (SHA-256 of its bytes), writable, and the new text
  encodable; one failure refuses them all (:class:`EditError`, nothing written). Then the journal
  (``edit_journal.py``: both versions of every file, outside the user's folders) is written and fsynced, and
  only then is each file replaced through ``specchat.backend.files.write_atomic`` — a reader, or a ``kill -9``
  at any moment, sees each file's old bytes or its new ones, never a part, and the next start completes an
  interrupted edit (``edit_journal.recover``). Permission bits are kept and, where allowed, the owner. If a
  later file fails, the files already written are put back. No backup or staging file is left beside the
  user's files. Model output is only ever written as file content, never executed.
- Line ends: unchanged lines keep their own (a file mixing CRLF and LF stays mixed); new lines take the
  file's most common one; a UTF-8 BOM is restored.
- :func:`undo_edit` puts back, byte for byte, every file of an :class:`AppliedEdit` from its journal, refusing
  (nothing written) when a file changed since the edit or the journal is gone or damaged; then the journal is
  removed. A kill mid-undo is completed at the next start.
- :func:`git_diff` is ``git diff`` of a file tracked by git (None when git is missing, the file is not
  tracked, or git fails or takes over 5 s); it runs git read-only, with no pager and no prompt.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from specchat.app.chat import edit_journal
from specchat.app.chat.edit_plan import EditPlan, FileChange, split_lines
from specchat.app.chat.editing import EditError, EditTarget, check_writable

GIT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class AppliedFile:
    path: Path  # the real file written
    shown: str  # the path as the user typed it
    backup: Path  # its original bytes (in the edit's journal, not beside the file)
    before_sha256: str  # of the original bytes
    after_sha256: str  # of the bytes written


@dataclass(frozen=True, slots=True)
class AppliedEdit:
    files: tuple[AppliedFile, ...]
    journal: Path | None = None  # the edit's journal folder (edit_journal.py)

    def describe(self) -> str:
        return ", ".join(f.shown for f in self.files)


def _applied(folder: Path, files: list[edit_journal.JournalFile]) -> AppliedEdit:
    return AppliedEdit(
        tuple(AppliedFile(Path(f.path), f.shown, folder / f"{i}.orig", f.before, f.after) for i, f in enumerate(files)),
        folder,
    )


def recover_edits() -> tuple[list[AppliedEdit], list[str]]:
    """At start: edits a killed specchat left, completed or taken back (``edit_journal.recover``); the applied
    ones for ``/undo`` (oldest first) and one sentence per edit acted on."""
    folders, notes = edit_journal.recover()
    edits = []
    for folder in folders:
        record = edit_journal.read(folder)
        if record is not None:
            edits.append(_applied(folder, record["files"]))
    return edits, notes


def restore_line_ends(target: EditTarget, new_text: str) -> str:
    """``new_text`` (``\\n`` line ends) with the file's own line ends put back: each unchanged line keeps its
    own; a changed or new line takes the ending of the line it replaces, else the file's most common one."""
    if not target.mixed_newlines:
        return new_text.replace("\n", target.newline) if target.newline != "\n" else new_text
    old = split_lines(target.original.replace("\r\n", "\n"))  # the same lines as target.text
    ends = ["\r\n" if line.endswith("\r\n") else "\n" for line in split_lines(target.original)]
    new = split_lines(new_text)
    out: list[str] = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        for k, line in enumerate(new[j1:j2]):
            if not line.endswith("\n"):
                out.append(line)
                continue
            source = i1 + k if op == "equal" or (op == "replace" and i1 + k < i2) else -1
            end = ends[source] if 0 <= source < len(ends) and old[source].endswith("\n") else target.newline
            out.append(line[:-1] + end)
    return "".join(out)


def _payload(change: FileChange) -> bytes:
    target = change.target
    try:
        return restore_line_ends(target, change.text).encode(target.encoding)
    except UnicodeEncodeError as exc:
        raise EditError(
            f"/edit {target.shown}: the new version cannot be saved as UTF-8 (character {exc.start}: "
            f"{exc.reason}). Nothing was written; ask the model again."
        ) from None


def _read_current(target: EditTarget) -> tuple[bytes, os.stat_result]:
    try:
        return target.path.read_bytes(), target.path.stat()
    except OSError as exc:
        raise EditError(
            f"/edit {target.shown}: cannot read {target.path} again before saving: "
            f"{exc.strerror or exc}. Nothing was written."
        ) from None


def apply_plan(plan: EditPlan) -> AppliedEdit:
    """Write every file of ``plan`` as one transaction (see the module docstring); what :func:`undo_edit` needs."""
    if not plan.ok:
        raise EditError(plan.message() if plan.refusals else "/edit: the edit changes no file. Nothing was written.")
    prepared: list[tuple[edit_journal.JournalFile, bytes, bytes]] = []
    for change in plan.changes:
        target = change.target
        current, st = _read_current(target)
        if hashlib.sha256(current).hexdigest() != target.sha256:
            raise EditError(
                f"/edit {target.shown}: {target.path} changed on disk since it was attached (modified "
                f"{time.strftime('%H:%M:%S', time.localtime(st.st_mtime))}); specchat will not overwrite those "
                f"changes. Nothing was written: run /edit {target.shown} again to edit the current version."
            )
        check_writable(target)
        payload = _payload(change)
        file = edit_journal.JournalFile(
            str(target.path),
            target.shown,
            target.sha256,
            hashlib.sha256(payload).hexdigest(),
            stat.S_IMODE(st.st_mode),
            st.st_uid,
            st.st_gid,
        )
        prepared.append((file, current, payload))
    try:
        folder = edit_journal.begin(prepared)
    except OSError as exc:
        raise EditError(
            f"/edit: could not write the edit's journal in {edit_journal.edits_dir()}: {exc.strerror or exc}. "
            "Nothing was written; check the free space and permissions of that folder."
        ) from None
    done: list[tuple[edit_journal.JournalFile, bytes]] = []
    for file, current, payload in prepared:
        try:
            edit_journal.put(file, payload)
        except OSError as exc:
            message = f"/edit {file.shown}: could not write {file.path}: {exc.strerror or exc}. The file is unchanged."
            raise EditError(message + _put_back(done, folder)) from None
        done.append((file, current))
    try:
        edit_journal.set_state(folder, "applied")
    except OSError:
        pass  # the files are written; the next start finds them so and marks the journal applied
    edit_journal.prune()
    return _applied(folder, [file for file, _, _ in prepared])


def apply_edit(target: EditTarget, new_text: str) -> Path:
    """Write ``new_text`` as the whole new content of ``target`` (no guard: the caller decided); the copy of
    its original bytes (in the edit's journal)."""
    new_text = new_text.replace("\r\n", "\n")
    if target.text and not target.text.endswith("\n") and new_text.endswith("\n"):
        new_text = new_text[:-1]  # a fenced block always ends its last line; keep the file's own convention
    return apply_plan(EditPlan(changes=(FileChange(target, new_text, "whole file"),))).files[0].backup


def _put_back(done: list[tuple[edit_journal.JournalFile, bytes]], folder: Path) -> str:
    """Restore the files already written (a later one failed) and drop the journal; a sentence saying so."""
    failed = []
    for file, original in done:
        try:
            edit_journal.put(file, original)
        except OSError:
            failed.append(file.path)
    if failed:  # keep the journal: the next start puts them back
        return " These files already written could not be put back yet: " + ", ".join(failed) + "."
    edit_journal.drop(folder)
    return " The files written before it were put back." if done else ""


def undo_edit(applied: AppliedEdit) -> list[Path]:
    """Put every file of ``applied`` back from its journal, byte for byte; returns the paths restored."""
    folder = applied.journal
    record = edit_journal.read(folder) if folder is not None else None
    if folder is None or record is None or record["state"] != "applied":
        raise EditError(
            f"/undo: the record of the edit of {applied.describe()} is gone (undone already, perhaps by another "
            "specchat). Nothing was restored."
        )
    files: list[edit_journal.JournalFile] = record["files"]
    originals = []
    for index, (f, file) in enumerate(zip(applied.files, files)):
        try:
            current = f.path.read_bytes()
            original = edit_journal.copy(folder, index, "orig")
        except OSError as exc:
            raise EditError(
                f"/undo: cannot read {exc.filename or f.path}: {exc.strerror or exc}. Nothing was restored."
            ) from None
        if hashlib.sha256(current).hexdigest() != file.after:
            raise EditError(
                f"/undo: {f.shown} changed since the edit was applied; undoing would lose those changes. "
                f"Nothing was restored; its original is in {folder / f'{index}.orig'}."
            )
        if hashlib.sha256(original).hexdigest() != file.before:
            raise EditError(
                f"/undo: the journal {folder} no longer holds the original of {f.shown}. Nothing was restored."
            )
        originals.append(original)
    try:
        edit_journal.set_state(folder, "undoing")
    except OSError as exc:
        raise EditError(
            f"/undo: cannot update the journal {folder}: {exc.strerror or exc}. Nothing was restored."
        ) from None
    done: list[Path] = []
    for file, original in zip(files, originals):
        try:
            edit_journal.put(file, original)
        except OSError as exc:
            restored = f" ({', '.join(map(str, done))} were restored)" if done else ""
            raise EditError(
                f"/undo: could not write {file.path}: {exc.strerror or exc}{restored}; the next start of specchat "
                "finishes the undo."
            ) from None
        done.append(Path(file.path))
    edit_journal.drop(folder)
    return done


def git_diff(path: Path) -> str | None:
    """``git diff`` of ``path`` when git tracks it (see the module docstring)."""
    git = shutil.which("git")
    if git is None:
        return None
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "GIT_PAGER": "cat"}
    folder = str(path.parent)
    try:
        tracked = subprocess.run(
            [git, "-C", folder, "ls-files", "--error-unmatch", "--", path.name],
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        if tracked.returncode != 0:
            return None
        diff = subprocess.run(
            [git, "-C", folder, "--no-pager", "diff", "--no-color", "--no-ext-diff", "--", path.name],
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if diff.returncode != 0:
        return None
    return diff.stdout.decode("utf-8", "replace")
