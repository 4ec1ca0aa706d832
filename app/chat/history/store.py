"""Conversation history: chats and their messages in one SQLite file, saved as they go.

Contract:
- The file is ``<data dir>/history.sqlite3`` unless a path is given; the data dir is
  ``specchat.backend.paths.data_dir()`` (which honours ``SPECCHAT_DATA_DIR``). The file is created owner-only
  (0600; SQLite gives its -wal/-shm files the same mode) and a missing folder is created 0700 (access.py).
- A file or folder the user made read-only (mode bits, also as root) is opened read-only and never changed:
  ``read_only`` is True, ``read_only_message`` says so for the UI, reads work and every write raises
  :class:`StoreError` without touching the file.
- Rows are read through ``records.summary_from_row`` / ``message_from_row``: whatever an older or damaged store
  left (invalid UTF-8, text or huge numbers as times, unknown roles, deeply nested stats) is shown as unreadable
  or skipped, never raised.
- WAL journal and a 10 s ``busy_timeout``: several specchat processes read and write the same history at once.
  Every write is one ``BEGIN IMMEDIATE`` transaction, so a second writer waits for the lock instead of failing.
  ``synchronous=NORMAL``: a committed write survives the process being killed (``kill -9``); a power cut may
  lose the last few commits but leaves the file consistent.
- The schema is versioned with ``PRAGMA user_version``: ``MIGRATIONS[i]`` takes version i to i + 1; pending
  ones run in order inside one transaction together with the version bump (all or nothing).
- A file that is not a database, or fails ``PRAGMA quick_check``, is renamed to
  ``history.sqlite3.corrupt-<timestamp>`` (never deleted) and a new empty history is started;
  ``recovered_from`` / ``recovery_message`` tell the UI, which shows the message. Nothing is raised for that.
- Threads: one connection opened with ``check_same_thread=False`` and serialised by a lock, so the UI thread and
  a saver's flusher thread (saver.py) share one store safely.
- Times (``created_at``, ``updated_at``) are Unix seconds (float). Message roles: system, user, assistant.

User-facing failures (unwritable folder, database locked too long, newer schema) raise :class:`StoreError`.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specchat.app.chat.history import access
from specchat.app.chat.history.access import BUSY_TIMEOUT_MS
from specchat.app.chat.history.records import (
    ROLES,
    ChatSummary,
    StoredMessage,
    StoreError,
    dump_stats,
    message_from_row,
    summary_from_row,
)
from specchat.backend.paths import data_dir, expand

log = logging.getLogger(__name__)

DB_NAME = "history.sqlite3"

# MIGRATIONS[i] upgrades a version-i database to version i + 1. Append only; never edit a released entry.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 0 -> 1: chats and their messages
        """CREATE TABLE chats (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            pair TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            created_at REAL NOT NULL)""",
    ),
    (  # 1 -> 2: per-reply statistics, and whether a reply finished (a streaming reply is saved incomplete)
        "ALTER TABLE messages ADD COLUMN stats TEXT",
        "ALTER TABLE messages ADD COLUMN complete INTEGER NOT NULL DEFAULT 1",
        "CREATE INDEX messages_by_chat ON messages(chat_id, id)",
        "CREATE INDEX chats_by_update ON chats(updated_at)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


class _Corrupt(Exception):
    pass


def _inserted_id(cur: sqlite3.Cursor) -> int:
    """The rowid of the row ``cur``'s INSERT added (sqlite3 sets ``lastrowid`` after every INSERT)."""
    assert cur.lastrowid is not None
    return int(cur.lastrowid)


class ChatStore:
    """The chat history. Safe to share between threads; several processes may open the same file."""

    def __init__(self, path: Path | None = None) -> None:
        in_data_dir = path is None
        self.path = (data_dir() / DB_NAME) if path is None else expand(path)
        self.recovered_from: Path | None = None  # where a damaged database was moved, if it was
        self.recovery_message: str | None = None  # the message to show the user about it
        self._lock = threading.RLock()
        self.read_only_reason = access.prepare(self.path, tighten=in_data_dir)  # None: writable
        try:
            try:
                self._conn: sqlite3.Connection | None = self._open()
            except StoreError as exc:
                reason = access.unwritable_reason(self.path, exc.__cause__)
                if self.read_only or reason is None:
                    raise
                self.read_only_reason = reason  # a full disk at start: show the chats, save nothing
                self._conn = self._open()
        except _Corrupt as exc:
            if self.read_only:
                raise StoreError(
                    f"the history file {self.path} is damaged ({exc}) and read-only "
                    f"({self.read_only_reason}); it was left as it is. Move it away or make it "
                    "writable, and start specchat again."
                ) from None
            moved = access.move_aside(self.path, str(exc))
            if moved is not None:
                self.recovered_from, self.recovery_message = moved
            self._conn = self._open()

    @property
    def read_only(self) -> bool:
        return self.read_only_reason is not None

    @property
    def read_only_message(self) -> str | None:
        """What the UI tells the user about a read-only history (None when writable)."""
        if self.read_only_reason is None:
            return None
        return (
            f"The chat history is read-only ({self.read_only_reason}): your chats are shown, but nothing new "
            "is saved. Make it writable (chmod u+w) to save chats."
        )

    # -- opening ---------------------------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        conn = access.connect(self.path, read_only=self.read_only)
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if not self.read_only:
                if access.set_wal(conn) != "wal":
                    log.warning(
                        "%s: this file system does not support WAL; concurrent writers will wait longer", self.path
                    )
                conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            check = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
            if check != ["ok"]:
                raise _Corrupt("; ".join(str(c) for c in check[:3]))
            self._migrate(conn)
        except sqlite3.Error as exc:
            conn.close()
            if access.is_corruption(exc):
                raise _Corrupt(str(exc)) from exc
            raise StoreError(
                f"cannot open the history file {self.path}: {exc}. If another specchat is busy with it, wait and "
                "retry; otherwise check the file's permissions."
            ) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if self.read_only:
            raise StoreError(
                f"the history file {self.path} has schema {version} (this specchat uses "
                f"{SCHEMA_VERSION}) and is read-only ({self.read_only_reason}), so it cannot be "
                "upgraded. Make it writable once, or use a specchat of its version."
            )
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"the history file {self.path} was written by a newer specchat (schema {version}; this one "
                    f"knows up to {SCHEMA_VERSION}). Upgrade specchat, or set SPECCHAT_DATA_DIR to another folder."
                )
            for step in MIGRATIONS[version:]:
                for statement in step:
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # -- transactions ------------------------------------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"the history {self.path} is closed; reopen it with ChatStore().")
        return self._conn

    @contextmanager
    def _read(self, what: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._connection()
            except sqlite3.Error as exc:
                raise StoreError(f"could not {what} from the history {self.path}: {exc}.") from exc

    @contextmanager
    def _write(self, what: str) -> Iterator[sqlite3.Connection]:
        if self.read_only_reason is not None:
            raise StoreError(
                f"could not {what}: the history {self.path} is read-only ({self.read_only_reason}); "
                "make it writable (chmod u+w) to save chats."
            )
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")  # take the write lock now: the busy timeout applies
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise StoreError(
                    f"could not {what} in the history {self.path}: {exc}. If the disk is full or another program "
                    "holds the file, free space or close it and retry."
                ) from exc

    @staticmethod
    def _touch(conn: sqlite3.Connection, chat_id: int, now: float) -> None:
        conn.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (now, chat_id))

    def _require_chat(self, conn: sqlite3.Connection, chat_id: int) -> None:
        if conn.execute("SELECT 1 FROM chats WHERE id = ?", (chat_id,)).fetchone() is None:
            raise StoreError(
                f"chat {chat_id} is not in the history {self.path}; it may have been deleted in another specchat "
                "window. Start a new chat."
            )

    # -- chats -----------------------------------------------------------------------------------------------
    def create_chat(self, title: str, pair: str) -> int:
        now = time.time()
        with self._write("create a chat") as conn:
            cur = conn.execute(
                "INSERT INTO chats (title, pair, created_at, updated_at) VALUES (?, ?, ?, ?)",
                (title.strip() or "New chat", pair, now, now),
            )
            return _inserted_id(cur)

    def list_chats(self) -> list[ChatSummary]:
        """All chats, the most recently active first."""
        with self._read("list chats") as conn:
            rows = conn.execute(
                "SELECT c.id, c.title, c.pair, c.created_at, c.updated_at,"
                " (SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id)"
                " FROM chats c ORDER BY c.updated_at DESC, c.id DESC"
            ).fetchall()
        return [summary_from_row(row) for row in rows]

    def chat(self, chat_id: int) -> ChatSummary:
        with self._read("read a chat") as conn:
            self._require_chat(conn, chat_id)
            row = conn.execute(
                "SELECT id, title, pair, created_at, updated_at,"
                " (SELECT COUNT(*) FROM messages WHERE chat_id = chats.id) FROM chats WHERE id = ?",
                (chat_id,),
            ).fetchone()
        return summary_from_row(row)

    def last_chat_id(self) -> int | None:
        with self._read("find the last chat") as conn:
            row = conn.execute("SELECT id FROM chats ORDER BY updated_at DESC, id DESC LIMIT 1").fetchone()
        return None if row is None else int(row[0])

    def rename_chat(self, chat_id: int, title: str) -> None:
        if not title.strip():
            raise StoreError(f"a chat title cannot be empty (chat {chat_id}); type a name.")
        with self._write("rename a chat") as conn:
            self._require_chat(conn, chat_id)
            conn.execute("UPDATE chats SET title = ? WHERE id = ?", (title.strip(), chat_id))

    def set_pair(self, chat_id: int, pair: str) -> None:
        """Record the model pair a chat continues with (after a switch in the picker)."""
        with self._write("change a chat's pair") as conn:
            self._require_chat(conn, chat_id)
            conn.execute("UPDATE chats SET pair = ? WHERE id = ?", (pair, chat_id))

    def delete_chat(self, chat_id: int) -> bool:
        """Delete a chat and its messages; False if it was already gone."""
        with self._write("delete a chat") as conn:
            return conn.execute("DELETE FROM chats WHERE id = ?", (chat_id,)).rowcount > 0

    # -- messages --------------------------------------------------------------------------------------------
    def messages(self, chat_id: int) -> list[StoredMessage]:
        with self._read("read messages") as conn:
            self._require_chat(conn, chat_id)
            rows = conn.execute(
                "SELECT id, role, content, stats, created_at, complete FROM messages WHERE chat_id = ? ORDER BY id",
                (chat_id,),
            ).fetchall()
        messages = [message_from_row(row) for row in rows]
        if None in messages:
            log.warning("%s: chat %s: skipped %d unreadable message(s)", self.path, chat_id, messages.count(None))
        return [m for m in messages if m is not None]

    def recent_replies(self, max_chars: int) -> list[str]:
        """The newest assistant replies of every chat, oldest first, up to about ``max_chars`` characters (the
        suffix drafter's memory of earlier replies is seeded with them). Unreadable rows are skipped."""
        replies: list[str] = []
        total = 0
        with self._read("read earlier replies") as conn:
            for (content,) in conn.execute("SELECT content FROM messages WHERE role = 'assistant' ORDER BY id DESC"):
                if not isinstance(content, str) or not content:
                    continue
                replies.append(content)
                total += len(content)
                if total >= max_chars:
                    break
        return replies[::-1]

    def add_message(
        self, chat_id: int, role: str, content: str, stats: dict | None = None, complete: bool = True
    ) -> int:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        now = time.time()
        with self._write("save a message") as conn:
            self._require_chat(conn, chat_id)
            cur = conn.execute(
                "INSERT INTO messages (chat_id, role, content, stats, created_at, complete) VALUES (?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, dump_stats(stats), now, int(complete)),
            )
            self._touch(conn, chat_id, now)
            return _inserted_id(cur)

    def update_message(
        self, message_id: int, content: str, stats: dict | None = None, complete: bool | None = None
    ) -> None:
        """Replace a message's content; ``stats`` / ``complete`` left as they are when None."""
        with self._write("save a reply") as conn:
            row = conn.execute("SELECT chat_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise StoreError(
                    f"message {message_id} is not in the history {self.path}; its chat may have been deleted in "
                    "another specchat window."
                )
            conn.execute(
                "UPDATE messages SET content = ?, stats = COALESCE(?, stats), complete = COALESCE(?, complete)"
                " WHERE id = ?",
                (content, dump_stats(stats), None if complete is None else int(complete), message_id),
            )
            self._touch(conn, row[0], time.time())

    def delete_messages_from(self, chat_id: int, message_id: int) -> int:
        """Delete message ``message_id`` of the chat and every later one (edit and resend); how many went."""
        with self._write("remove messages") as conn:
            count = conn.execute("DELETE FROM messages WHERE chat_id = ? AND id >= ?", (chat_id, message_id)).rowcount
            self._touch(conn, chat_id, time.time())
            return int(count)

    def delete_last_assistant(self, chat_id: int) -> int | None:
        """Delete the chat's last message if it is an assistant reply (regenerate); returns its id or None."""
        with self._write("remove the last reply") as conn:
            row = conn.execute(
                "SELECT id, role FROM messages WHERE chat_id = ? ORDER BY id DESC LIMIT 1", (chat_id,)
            ).fetchone()
            if row is None or row[1] != "assistant":
                return None
            conn.execute("DELETE FROM messages WHERE id = ?", (row[0],))
            self._touch(conn, chat_id, time.time())
            return int(row[0])

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
