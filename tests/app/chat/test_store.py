"""Chat history (app/chat/history/store.py): CRUD, reopen, threads, WAL with two writers, corrupt files moved aside,
schema migration, owner-only permissions."""

from __future__ import annotations

import os
import re
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from specchat.app.chat.history.records import StoreError
from specchat.app.chat.history.store import MIGRATIONS, SCHEMA_VERSION, ChatStore


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- CRUD -----------------------------------------------------------------------------------------------------
def test_chats_and_messages_round_trip(store: ChatStore) -> None:
    first = store.create_chat("First", "smollm2-135m")
    second = store.create_chat("Second", "qwen-7b")
    u = store.add_message(first, "user", "hello")
    a = store.add_message(first, "assistant", "hi there", stats={"tokens": 3, "acceptance_rate": 0.5})
    store.add_message(second, "user", "other")

    msgs = store.messages(first)
    assert [(m.id, m.role, m.content, m.complete) for m in msgs] == [
        (u, "user", "hello", True),
        (a, "assistant", "hi there", True),
    ]
    assert msgs[1].stats == {"tokens": 3, "acceptance_rate": 0.5}
    assert msgs[0].stats is None

    # Newest activity first: adding to `first` moves it to the top.
    assert [c.id for c in store.list_chats()] == [second, first]
    time.sleep(0.01)
    store.add_message(first, "user", "again")
    chats = store.list_chats()
    assert [(c.id, c.title, c.pair, c.message_count) for c in chats] == [
        (first, "First", "smollm2-135m", 3),
        (second, "Second", "qwen-7b", 1),
    ]
    assert chats[0].updated_at >= chats[0].created_at
    assert store.last_chat_id() == first

    store.rename_chat(second, "  Renamed  ")
    store.set_pair(second, "other-pair")
    assert (store.chat(second).title, store.chat(second).pair) == ("Renamed", "other-pair")
    with pytest.raises(StoreError, match="title cannot be empty"):
        store.rename_chat(second, "   ")

    assert store.delete_chat(second) is True
    assert store.delete_chat(second) is False
    assert [c.id for c in store.list_chats()] == [first]
    with pytest.raises(StoreError, match=rf"chat {second} is not in the history .*history.sqlite3.*new chat"):
        store.messages(second)
    with pytest.raises(StoreError, match=rf"chat {second} is not in the history"):
        store.add_message(second, "user", "x")
    with pytest.raises(ValueError, match="role must be one of"):
        store.add_message(first, "robot", "x")


def test_last_chat_id_of_empty_history_is_none(store: ChatStore) -> None:
    assert store.last_chat_id() is None
    assert store.list_chats() == []


def test_update_message_keeps_unspecified_fields(store: ChatStore) -> None:
    chat = store.create_chat("c", "p")
    mid = store.add_message(chat, "assistant", "", complete=False)
    store.update_message(mid, "partial")
    m = store.messages(chat)[0]
    assert (m.content, m.stats, m.complete) == ("partial", None, False)
    store.update_message(mid, "done", stats={"tok_s": 12.5}, complete=True)
    store.update_message(mid, "done!")  # stats and complete stay
    m = store.messages(chat)[0]
    assert (m.content, m.stats, m.complete) == ("done!", {"tok_s": 12.5}, True)
    with pytest.raises(StoreError, match="message 999 is not in the history"):
        store.update_message(999, "x")


def test_delete_last_assistant_only_removes_a_trailing_reply(store: ChatStore) -> None:
    chat = store.create_chat("c", "p")
    store.add_message(chat, "user", "q1")
    a1 = store.add_message(chat, "assistant", "a1")
    assert store.delete_last_assistant(chat) == a1
    assert store.delete_last_assistant(chat) is None  # the last message is now the user's
    assert [m.content for m in store.messages(chat)] == ["q1"]
    assert store.delete_last_assistant(store.create_chat("empty", "p")) is None


def test_reopen_continues_the_chat(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    with ChatStore(path) as s:
        chat = s.create_chat("kept", "p")
        first = s.add_message(chat, "user", "before restart")
    with ChatStore(path) as s:
        assert s.last_chat_id() == chat
        assert [m.content for m in s.messages(chat)] == ["before restart"]
        second = s.add_message(chat, "assistant", "after restart")
        assert second > first
        assert [m.content for m in s.messages(chat)] == ["before restart", "after restart"]
    closed = ChatStore(path)
    closed.close()
    with pytest.raises(StoreError, match="is closed"):
        closed.list_chats()


def test_threads_share_one_store(store: ChatStore) -> None:
    chat = store.create_chat("threads", "p")

    def writer(k: int) -> None:
        for i in range(40):
            store.add_message(chat, "user", f"{k}-{i}")

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(m.content for m in store.messages(chat)) == sorted(f"{k}-{i}" for k in range(4) for i in range(40))


# -- files, permissions, WAL ----------------------------------------------------------------------------------
def test_default_location_honours_specchat_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "specchat-data"
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(data))
    with ChatStore() as s:
        assert s.path == data / "history.sqlite3"
        s.create_chat("x", "p")
    assert (data / "history.sqlite3").is_file()
    assert _mode(data) == 0o700


def test_owner_only_permissions_and_wal(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # the most permissive umask: the modes must not depend on it
    try:
        with ChatStore(tmp_path / "new" / "deeper" / "history.sqlite3") as s:
            s.add_message(s.create_chat("x", "p"), "user", "secret")
            folder = s.path.parent
            assert _mode(folder) == 0o700
            for file in folder.iterdir():  # the database and its -wal / -shm files
                assert _mode(file) == 0o600, file
            assert {f.name for f in folder.iterdir()} >= {"history.sqlite3", "history.sqlite3-wal"}
            assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert s._conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 5000
    finally:
        os.umask(old_umask)


def test_existing_world_readable_database_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    ChatStore(path).close()
    os.chmod(path, 0o644)
    ChatStore(path).close()
    assert _mode(path) == 0o600


TWO_WRITERS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from specchat.app.chat.history.store import ChatStore
    db, go, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    while not go.exists():
        time.sleep(0.002)
    store = ChatStore(db)  # both open (and create + migrate) a fresh file at the same moment
    chat = store.create_chat(name, "p")
    for i in range(150):
        mid = store.add_message(chat, "user", f"{name}-{i}")
        store.update_message(mid, f"{name}-{i}", stats={"i": i})
    store.close()
    """
)


def test_two_processes_write_at_once(tmp_path: Path) -> None:
    db, go = tmp_path / "data" / "history.sqlite3", tmp_path / "go"
    script = tmp_path / "writer.py"
    script.write_text(TWO_WRITERS)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(db), str(go), name], stderr=subprocess.PIPE, text=True)
        for name in ("alpha", "beta")
    ]
    time.sleep(0.5)  # both interpreters are up and polling
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    with ChatStore(db) as s:
        chats = {c.title: c for c in s.list_chats()}
        assert set(chats) == {"alpha", "beta"}
        for name, chat in chats.items():
            msgs = s.messages(chat.id)
            assert [m.content for m in msgs] == [f"{name}-{i}" for i in range(150)]
            assert [m.stats for m in msgs] == [{"i": i} for i in range(150)]


# -- damaged files and schema versions ------------------------------------------------------------------------
def test_not_a_database_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    garbage = b"this is not an SQLite file\n" * 200
    path.write_bytes(garbage)
    with ChatStore(path) as s:
        assert s.recovered_from is not None
        assert s.recovered_from.name.startswith("history.sqlite3.corrupt-")
        assert s.recovered_from.read_bytes() == garbage  # kept byte for byte
        msg = s.recovery_message
        assert str(path) in msg and str(s.recovered_from) in msg
        assert "nothing was deleted" in msg and "new, empty history" in msg
        assert s.list_chats() == []
        s.create_chat("fresh", "p")  # the new history works
    with ChatStore(path) as s:  # and is healthy on the next start
        assert s.recovered_from is None and s.recovery_message is None
        assert [c.title for c in s.list_chats()] == ["fresh"]


def test_malformed_database_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    with ChatStore(path) as s:
        chat = s.create_chat("doomed", "p")
        for i in range(200):
            s.add_message(chat, "user", f"message {i} " * 20)
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page * 2 : page * 4] = b"\xa5" * (page * 2)  # scribble over the b-tree pages after the schema page
    path.write_bytes(bytes(data))
    with ChatStore(path) as s:
        assert s.recovered_from is not None and s.recovered_from.read_bytes() == bytes(data)
        assert "was damaged" in s.recovery_message
        assert s.list_chats() == []


def test_migration_from_version_1(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    conn = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO chats (title, pair, created_at, updated_at) VALUES ('old', 'p', 1.0, 2.0)")
    conn.execute("INSERT INTO messages (chat_id, role, content, created_at) VALUES (1, 'user', 'from v1', 1.5)")
    conn.commit()
    conn.close()
    assert SCHEMA_VERSION > 1
    with ChatStore(path) as s:
        assert s._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        (msg,) = s.messages(1)
        assert (msg.content, msg.stats, msg.complete, msg.created_at) == ("from v1", None, True, 1.5)
        s.add_message(1, "assistant", "new", stats={"a": 1}, complete=False)
        assert s.messages(1)[1].stats == {"a": 1}


def test_a_failing_migration_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "history.sqlite3"
    conn = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    import specchat.app.chat.history.store as store_module

    broken = (MIGRATIONS[1][0], "THIS IS NOT SQL")
    monkeypatch.setattr(store_module, "MIGRATIONS", (MIGRATIONS[0], broken))
    with pytest.raises(StoreError, match="cannot open the history file"):
        ChatStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    assert "stats" not in [row[1] for row in conn.execute("PRAGMA table_info(messages)")]  # rolled back
    conn.close()


def test_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=rf"{re.escape(str(path))}.*newer specchat \(schema 99.*Upgrade specchat"):
        ChatStore(path)
    assert path.exists() and not list(tmp_path.glob("*.corrupt-*"))
