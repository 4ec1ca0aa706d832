"""Reaching the history file on disk, for :class:`~.store.ChatStore`: its folder and file permissions, the SQLite
connection (read-write in WAL mode, or read-only), and moving a damaged file aside.

Contract:
- :func:`prepare` decides once whether the history is read-only, from the mode bits (``files.read_only_reason``:
  the file, or the folder that holds or would hold it, has no write permission; for root, none at all). A
  read-only history is never chmodded, created or written: it is opened read-only and the store says so. A
  writable one gets a missing folder created 0700 and the file created 0600 before SQLite does (SQLite would use
  the umask); group and other bits of existing files (and, with ``tighten``, of specchat's own data folder) are
  removed, owner bits never added.
- A writable-looking history that SQLite cannot open for writing (a disk full at start: no room for the -wal and
  -shm files) is opened read-only instead, :func:`unwritable_reason` saying why, so its chats still show.
- :func:`connect` opens the connection with the busy timeout and text read as UTF-8 with bad bytes replaced (a
  title written by a damaged store never hides the list). Read-only: ``mode=ro``, or ``immutable=1`` when no
  (or an empty) ``-wal`` file holds unmerged commits (then nothing at all is created beside the file).
- :func:`move_aside` renames a damaged file (and its -wal/-shm) to ``<name>.corrupt-<timestamp>`` and returns
  where it went and the message for the user; nothing is deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import stat
import time
import urllib.parse
from pathlib import Path

from specchat.app.chat.history.records import StoreError
from specchat.backend.files import read_only_reason

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 10_000
_CORRUPTION_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB (primary result codes)
_UNWRITABLE_CODES = {8, 10, 13, 14}  # SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN


def is_corruption(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _CORRUPTION_CODES
    text = str(exc).lower()
    return "not a database" in text or "malformed" in text


def set_wal(conn: sqlite3.Connection) -> str:
    """Switch to WAL; returns the journal mode in force. Switching needs an exclusive lock and SQLite may answer
    "database is locked" at once, without calling the busy handler, while another process is creating the same
    file: retry for up to the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _owner_only(path: Path) -> None:
    """Remove group and other bits of a file or folder we own (never adds a bit: read-only stays read-only)."""
    try:
        st = path.stat()
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:
        pass  # absent side file, or not ours: SQLite reports real access problems


def prepare(path: Path, *, tighten: bool) -> str | None:
    """Get ``path``'s folder and file ready; returns why the history is read-only, or None (writable)."""
    reason = read_only_reason(path)
    if reason is not None:
        if not path.exists():
            raise StoreError(
                f"cannot create the history file {path}: {reason}. Make it writable, or set "
                "SPECCHAT_DATA_DIR to a folder you can write."
            )
        return reason
    folder = path.parent
    try:
        if not folder.exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(folder, 0o700)
        elif tighten:
            _owner_only(folder)  # specchat's own data folder: owner only
    except OSError as exc:
        raise StoreError(
            f"cannot create the history folder {folder}: {exc.strerror or exc}. Make it writable, or "
            "set SPECCHAT_DATA_DIR to a folder you can write."
        ) from exc
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreError(
            f"cannot create the history file {path}: {exc.strerror or exc}. Make its folder "
            "writable, or set SPECCHAT_DATA_DIR to a folder you can write."
        ) from exc
    for suffix in ("", "-wal", "-shm"):
        _owner_only(Path(f"{path}{suffix}"))
    return None


def unwritable_reason(path: Path, error: BaseException | None) -> str | None:
    """Why a writable-looking history failed to open for writing (a full disk, an I/O error), when opening it
    read-only could still show its chats; None for other failures (locked, damaged, newer schema)."""
    code = getattr(error, "sqlite_errorcode", None)
    if not isinstance(error, sqlite3.Error) or code is None or (code & 0xFF) not in _UNWRITABLE_CODES:
        return None
    try:
        full = shutil.disk_usage(path.parent).free < 1 << 20
    except OSError:
        full = False
    return f"the disk holding {path.parent} is full" if full else f"it cannot be opened for writing ({error})"


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def connect(path: Path, *, read_only: bool) -> sqlite3.Connection:
    """A connection to ``path`` (see the module docstring); StoreError when SQLite cannot open it."""
    target: str | Path = path
    if read_only:
        try:
            unmerged = Path(f"{path}-wal").stat().st_size > 0
        except OSError:
            unmerged = False
        option = "mode=ro" if unmerged else "immutable=1"
        target = f"file:{urllib.parse.quote(os.fspath(path))}?{option}"
    try:
        conn = sqlite3.connect(
            target, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False, uri=read_only
        )
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open the history file {path}: {exc}. Check its permissions.") from exc
    conn.text_factory = _text
    return conn


def move_aside(path: Path, reason: str) -> tuple[Path, str] | None:
    """Rename the damaged ``path`` (and its -wal/-shm) aside; (where, message), or None if another specchat
    already did. StoreError when it cannot be moved."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    try:
        os.replace(path, dest)
        for suffix in ("-wal", "-shm"):  # the journal belongs to the damaged file: keep them together
            side = Path(f"{path}{suffix}")
            if side.exists():
                os.replace(side, Path(f"{dest}{suffix}"))
    except FileNotFoundError:
        return None  # another specchat moved it aside first (and tells its user)
    except OSError as exc:
        raise StoreError(
            f"the history file {path} is damaged ({reason}) and could not be moved aside: "
            f"{exc.strerror or exc}. Move it away yourself (nothing was deleted) and start specchat again."
        ) from exc
    message = (
        f"The chat history {path} was damaged ({reason}). It was moved to {dest} — nothing was "
        "deleted — and a new, empty history was started. Older chats may be recoverable from that file "
        "with the sqlite3 shell's .recover command."
    )
    log.warning("%s", message)
    return dest, message
