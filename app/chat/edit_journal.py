"""The journal that makes a multi-file ``/edit`` one transaction: written before any file changes, so that a
process killed at any moment leaves an edit that the next start completes (or, when a file changed meanwhile,
takes back), with ``/undo`` still possible.

Contract:

- A journal is a folder in ``<data dir>/edits/`` (never beside the user's files): ``journal.json`` (its state,
  the pid that wrote it, and per file the real path, the path as shown, the SHA-256 before and after, the mode,
  owner and group) and two copies per file, ``<i>.orig`` and ``<i>.new``. :func:`begin` writes all of it under
  a ``.tmp`` name, fsynced, then renames the folder into place: until that rename nothing of the edit exists,
  after it everything needed to finish or undo it does.
- States: ``applying`` (files being written), ``applied`` (every file holds its new bytes: what ``/undo``
  reads), ``undoing`` (files being put back). :func:`set_state` rewrites journal.json atomically; :func:`drop`
  removes the folder (an undone or rolled-back edit leaves nothing).
- :func:`recover` (at start) looks at every journal whose writer is dead: ``applying`` is completed (each file
  holding its old bytes gets the new ones) unless some file holds neither version, in which case the files
  already changed get their old bytes back and the journal is dropped; ``undoing`` is completed the same way
  backwards; ``applied`` ones are returned for ``/undo``. A leftover ``.tmp`` folder is removed (nothing was
  changed), and so are the temporary files a killed ``write_atomic`` left beside a journal's files. Each
  outcome is one sentence for the user. It never raises for a damaged journal: it names it and leaves it.
- :func:`prune` keeps the newest :data:`KEEP` applied journals of dead writers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specchat.backend.files import fsync_folder, remove_stale_temporaries, write_atomic
from specchat.backend.paths import data_dir

KEEP = 20  # applied journals kept for /undo across sessions
VERSION = 1


@dataclass(frozen=True, slots=True)
class JournalFile:
    path: str  # the real file
    shown: str  # as the user typed it
    before: str  # SHA-256 of the original bytes
    after: str  # SHA-256 of the new bytes
    mode: int
    uid: int
    gid: int


def edits_dir() -> Path:
    return data_dir() / "edits"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def _write_journal(folder: Path, state: str, files: list[JournalFile]) -> None:
    record = {"version": VERSION, "state": state, "pid": os.getpid(), "files": [asdict(f) for f in files]}
    write_atomic(folder / "journal.json", json.dumps(record, indent=1).encode(), mode=0o600)


def begin(files: list[tuple[JournalFile, bytes, bytes]]) -> Path:
    """Write a journal in state ``applying`` with both versions of every file; its folder (OSError when it
    cannot: nothing of the edit exists then)."""
    root = edits_dir()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**9:09d}-{os.getpid()}"
    staging = root / f".{name}.tmp"
    staging.mkdir(mode=0o700)
    try:
        for index, (_, original, new) in enumerate(files):
            write_atomic(staging / f"{index}.orig", original, mode=0o600)
            write_atomic(staging / f"{index}.new", new, mode=0o600)
        _write_journal(staging, "applying", [f for f, _, _ in files])
        folder = root / name
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_folder(root)
    return folder


def set_state(folder: Path, state: str) -> None:
    record = read(folder)
    if record is None:
        raise OSError(f"the journal {folder} is gone")
    _write_journal(folder, state, record["files"])


def drop(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def read(folder: Path) -> dict[str, Any] | None:
    """The journal's record (files as :class:`JournalFile`), None when it is missing or damaged."""
    try:
        record = json.loads((folder / "journal.json").read_text(encoding="utf-8"))
        record["files"] = [JournalFile(**f) for f in record["files"]]
        if record["state"] not in ("applying", "applied", "undoing") or not isinstance(record["pid"], int):
            return None
        return record
    except (OSError, ValueError, TypeError, KeyError):
        return None


def copy(folder: Path, index: int, which: str) -> bytes:
    """The original (``orig``) or new (``new``) bytes of file ``index``."""
    return (folder / f"{index}.{which}").read_bytes()


def _current(path: Path) -> str | None:
    try:
        return sha256(path.read_bytes())
    except OSError:
        return None


def put(file: JournalFile, data: bytes) -> None:
    """Write ``data`` as ``file``'s content, with its mode and (where allowed) owner."""
    path = Path(file.path)
    write_atomic(path, data, mode=file.mode)
    if hasattr(os, "chown") and (file.uid, file.gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(path, file.uid, file.gid)
        except OSError:
            pass


def _move(folder: Path, files: list[JournalFile], to_new: bool) -> list[str]:
    """Bring every file to its new (or old) bytes; the files that hold neither version (left as they are)."""
    strangers = []
    for index, file in enumerate(files):
        remove_stale_temporaries(file.path)
        have = _current(Path(file.path))
        want, other = (file.after, file.before) if to_new else (file.before, file.after)
        if have == want:
            continue
        if have != other:
            strangers.append(file.shown)
            continue
        put(file, copy(folder, index, "new" if to_new else "orig"))
    return strangers


def recover() -> tuple[list[Path], list[str]]:
    """Finish what killed processes left (see the module docstring): (applied journals for /undo, oldest
    first; one sentence per journal acted on)."""
    root = edits_dir()
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return [], []
    applied: list[Path] = []
    notes: list[str] = []
    for folder in entries:
        if folder.name.startswith(".") and folder.name.endswith(".tmp"):
            pid = folder.name[1:-4].rsplit("-", 1)[-1]
            if not (pid.isdigit() and _alive(int(pid))):
                drop(folder)  # killed before the journal existed: no file was touched
            continue
        record = read(folder)
        if record is None:
            if folder.is_dir() and not folder.name.startswith("."):
                notes.append(f"/edit: the journal {folder} is damaged; specchat left it (and the files) as they are.")
            continue
        if _alive(record["pid"]):
            continue  # another specchat's (or this one's): not ours to finish
        try:
            notes += _recover_one(folder, record, applied)
        except OSError as error:
            notes.append(f"/edit: could not finish the interrupted edit in {folder}: {error.strerror or error}.")
    return applied, [n for n in notes if n]


def _recover_one(folder: Path, record: dict[str, Any], applied: list[Path]) -> list[str]:
    files: list[JournalFile] = record["files"]
    names = ", ".join(f.shown for f in files)
    if record["state"] == "applied":
        applied.append(folder)
        return []
    if record["state"] == "undoing":
        strangers = _move(folder, files, to_new=False)
        drop(folder)
        if strangers:
            return [f"/undo was interrupted; {', '.join(strangers)} changed since, so it was left as it is."]
        return [f"/undo was interrupted; it is now complete: {names} hold their bytes from before the edit."]
    strangers = _move(folder, files, to_new=True)
    if not strangers:
        _write_journal(folder, "applied", files)
        applied.append(folder)
        return [f"An /edit of {names} was interrupted; it is now complete (/undo takes it back)."]
    _move(folder, files, to_new=False)
    drop(folder)
    return [
        f"An /edit of {names} was interrupted and {', '.join(strangers)} changed since; the other files were "
        "put back as they were before the edit."
    ]


def prune(keep: int = KEEP) -> None:
    """Drop the oldest applied journals of dead writers beyond the newest ``keep``."""
    try:
        folders = sorted(p for p in edits_dir().iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return
    old = []
    for folder in folders:
        record = read(folder)
        if record is not None and record["state"] == "applied":
            old.append(folder)
    for folder in old[:-keep] if len(old) > keep else []:
        drop(folder)
