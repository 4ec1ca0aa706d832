"""Writing an accepted ``/edit`` to disk, taking it back with ``/undo``, and showing git's view of it.

Contract:
- :func:`apply_plan` writes the files of an :class:`~specchat.app.chat.edit_plan.EditPlan` (only their real
  paths: a symlink stays a link to the file it names) after the user's confirmation. Before writing anything
  it checks every file: unchanged since it was attached (SHA-256 of its bytes), writable, and the new text
  encodable; one failure refuses them all (:class:`EditError`, nothing written). Then, per file, the original
  bytes go to a new ``<name>.specchat-bak-<timestamp>[-n]`` (never overwriting anything) and the new content
  replaces the file through ``specchat.backend.files.write_atomic`` — a reader, or a ``kill -9`` at any moment,
  sees the old bytes or the new ones, never a part; the backup is complete before it takes its name.
  Permission bits are kept and, where allowed, the owner. If a later file fails, the files already written
  are put back from their originals. Model output is only ever written as file content, never executed.
- Line ends: unchanged lines keep their own (a file mixing CRLF and LF stays mixed); new lines take the
  file's most common one; a UTF-8 BOM is restored.
- :func:`undo_edit` puts back, byte for byte, every file of an :class:`AppliedEdit` from its backup, refusing
  (nothing written) when a file changed since the edit or a backup is no longer the original. Once every file
  is back, its backups are deleted (the file itself holds those bytes again): an undone edit leaves no
  ``.specchat-bak`` file behind; a backup that cannot be deleted is named in :attr:`Undone.kept`.
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

from specchat.app.chat.edit_plan import EditPlan, FileChange, split_lines
from specchat.app.chat.editing import EditError, EditTarget, check_writable
from specchat.backend.files import write_atomic

BACKUP_MARK = ".specchat-bak"
GIT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class AppliedFile:
    path: Path  # the real file written
    shown: str  # the path as the user typed it
    backup: Path  # its original bytes
    before_sha256: str  # of the original bytes (the backup's)
    after_sha256: str  # of the bytes written


@dataclass(frozen=True, slots=True)
class AppliedEdit:
    files: tuple[AppliedFile, ...]

    def describe(self) -> str:
        return ", ".join(f"{f.shown} (backup: {f.backup.name})" for f in self.files)


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
    """Write every file of ``plan`` (see the module docstring); returns what :func:`undo_edit` needs."""
    if not plan.ok:
        raise EditError(plan.message() if plan.refusals else "/edit: the edit changes no file. Nothing was written.")
    prepared: list[tuple[FileChange, bytes, os.stat_result, bytes]] = []
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
        prepared.append((change, current, st, _payload(change)))
    done: list[tuple[AppliedFile, bytes, int]] = []
    for change, current, st, payload in prepared:
        target, mode = change.target, stat.S_IMODE(st.st_mode)
        try:
            backup = _write_backup(target, current, mode)
        except EditError as exc:
            raise EditError(f"{exc}{_put_back(done)}") from None
        try:
            write_atomic(target.path, payload, mode=mode)
        except OSError as exc:
            raise EditError(
                f"/edit {target.shown}: could not write {target.path}: {exc.strerror or exc}. The file "
                f"is unchanged; the backup is {backup}.{_put_back(done)}"
            ) from None
        _keep_owner(target.path, st)
        done.append(
            (
                AppliedFile(target.path, target.shown, backup, target.sha256, hashlib.sha256(payload).hexdigest()),
                current,
                mode,
            )
        )
    return AppliedEdit(tuple(applied for applied, _, _ in done))


def apply_edit(target: EditTarget, new_text: str) -> Path:
    """Write ``new_text`` as the whole new content of ``target`` (no guard: the caller decided); its backup."""
    new_text = new_text.replace("\r\n", "\n")
    if target.text and not target.text.endswith("\n") and new_text.endswith("\n"):
        new_text = new_text[:-1]  # a fenced block always ends its last line; keep the file's own convention
    return apply_plan(EditPlan(changes=(FileChange(target, new_text, "whole file"),))).files[0].backup


def _put_back(done: list[tuple[AppliedFile, bytes, int]]) -> str:
    """Restore the files already written (a later one failed); a sentence saying so ("" when none)."""
    failed = []
    for applied, original, mode in done:
        try:
            write_atomic(applied.path, original, mode=mode)
        except OSError:
            failed.append(f"{applied.path} (its backup is {applied.backup})")
    if failed:
        return " These files already written could not be put back: " + ", ".join(failed) + "."
    return " The files written before it were put back." if done else ""


def _keep_owner(path: Path, st: os.stat_result) -> None:
    if hasattr(os, "chown") and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(path, st.st_uid, st.st_gid)
        except OSError:
            pass  # not allowed (not root): the new file is ours, as any editor would leave it


def _write_backup(target: EditTarget, data: bytes, mode: int) -> Path:
    """The original bytes under a new ``<name>.specchat-bak-<timestamp>[-n]``: written whole under a temporary
    name, then linked to a name no file has (a link never replaces one), so a backup is never partial."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    staging = target.path.with_name(f".{target.path.name}{BACKUP_MARK}.{os.getpid()}.{os.urandom(3).hex()}")
    try:
        write_atomic(staging, data, mode=mode | stat.S_IRUSR | stat.S_IWUSR)
    except OSError as exc:
        raise EditError(
            f"/edit {target.shown}: could not write a backup next to {target.path}: "
            f"{exc.strerror or exc}. Nothing was written."
        ) from None
    try:
        for n in range(1, 1000):
            backup = target.path.with_name(f"{target.path.name}{BACKUP_MARK}-{stamp}{'' if n == 1 else f'-{n}'}")
            try:
                os.link(staging, backup)
                return backup
            except FileExistsError:
                continue
            except OSError:  # a file system without hard links: check, then rename
                if backup.exists() or backup.is_symlink():
                    continue
                os.replace(staging, backup)
                return backup
        raise EditError(
            f"/edit {target.shown}: 999 backups from this second already exist next to it; remove "
            "some. Nothing was written."
        )
    except OSError as exc:
        raise EditError(
            f"/edit {target.shown}: could not name the backup of {target.path}: "
            f"{exc.strerror or exc}. Nothing was written."
        ) from None
    finally:
        staging.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class Undone:
    """What :func:`undo_edit` did: the files restored, and the backups it could not delete (with why)."""

    restored: list[Path]
    kept: list[str]


def undo_edit(applied: AppliedEdit) -> Undone:
    """Put every file of ``applied`` back from its backup, byte for byte, then delete the backups."""
    restore: list[tuple[AppliedFile, bytes, int]] = []
    for f in applied.files:
        try:
            current, st = f.path.read_bytes(), f.path.stat()
            original = f.backup.read_bytes()
        except OSError as exc:
            raise EditError(
                f"/undo: cannot read {exc.filename or f.path}: {exc.strerror or exc}. Nothing was restored."
            ) from None
        if hashlib.sha256(current).hexdigest() != f.after_sha256:
            raise EditError(
                f"/undo: {f.shown} changed since the edit was applied; undoing would lose those changes. "
                f"Nothing was restored; its original is in {f.backup}."
            )
        if hashlib.sha256(original).hexdigest() != f.before_sha256:
            raise EditError(
                f"/undo: the backup {f.backup} no longer holds the original of {f.shown}. Nothing was restored."
            )
        restore.append((f, original, stat.S_IMODE(st.st_mode)))
    done: list[Path] = []
    for f, original, mode in restore:
        try:
            write_atomic(f.path, original, mode=mode)
        except OSError as exc:
            restored = f" ({', '.join(map(str, done))} were restored)" if done else ""
            raise EditError(
                f"/undo: could not write {f.path}: {exc.strerror or exc}{restored}; its original is in {f.backup}."
            ) from None
        done.append(f.path)
    kept = []
    for f in applied.files:  # every file holds its original again: the backups are copies of it
        try:
            f.backup.unlink()
        except OSError as exc:
            kept.append(f"{f.backup} ({exc.strerror or exc})")
    return Undone(done, kept)


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
