"""Chat history (app/chat/history/store.py): CRUD, reopen, export, WAL with two writers, kill -9 while a reply streams,
corrupt files moved aside, schema migration, owner-only permissions, and the StreamingSaver's timing."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from specchat.app.chat.history.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ChatStore,
    StoreError,
    StreamingSaver,
)


@pytest.fixture
def store(tmp_path: Path):
    s = ChatStore(tmp_path / "data" / "history.sqlite3")
    yield s
    s.close()


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


# -- export ---------------------------------------------------------------------------------------------------
def test_export_markdown(store: ChatStore, tmp_path: Path) -> None:
    chat = store.create_chat("Fix my loop / please", "smollm2-135m")
    store.add_message(chat, "user", "Why does `for i in range(3)` stop at 2?")
    store.add_message(chat, "assistant", "Because range excludes the end.\n\n```python\nprint(list(range(3)))\n```\n",
                      stats={"tokens": 42, "tokens_per_s": 31.25, "acceptance_rate": 0.6667, "per_position": [1, 2]})
    store.add_message(chat, "assistant", "Half a rep", complete=False)

    out = store.export_markdown(chat, tmp_path / "chat.md")
    assert out == tmp_path / "chat.md"
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# Fix my loop / please\n")
    assert "`smollm2-135m`" in text and "3 messages" in text
    assert "## You · " in text and "## Assistant · " in text
    assert "Why does `for i in range(3)` stop at 2?" in text
    assert "```python\nprint(list(range(3)))\n```" in text
    assert "*tokens: 42 · tokens_per_s: 31.2 · acceptance_rate: 0.667*" in text  # lists are left out
    assert "Half a rep\n\n*(reply interrupted: partial text)*" in text
    assert text.index("stop at 2?") < text.index("Because range") < text.index("Half a rep")

    into_folder = store.export_markdown(chat, tmp_path)
    assert into_folder == tmp_path / "Fix-my-loop-please.md"
    assert into_folder.read_text(encoding="utf-8") == text

    with pytest.raises(StoreError, match=r"could not export the chat to .*no-such-dir.*Choose a folder"):
        store.export_markdown(chat, tmp_path / "no-such-dir" / "x.md")


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


# -- kill -9 while a reply streams ----------------------------------------------------------------------------
STREAMER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from specchat.app.chat.history.store import ChatStore, StreamingSaver
    db, log, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    store = ChatStore(db)
    chat = store.create_chat("killed", "p")
    for i in range(3):
        store.add_message(chat, "user", f"question {i}")
        store.add_message(chat, "assistant", f"answer {i}", stats={"i": i})
    store.add_message(chat, "user", "last question")
    saver = StreamingSaver(store, store.add_message(chat, "assistant", "", complete=False), interval_s=0.5)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    total = 0
    for i in range(100000):
        piece = f"t{i} "
        saver.append(piece)
        total += len(piece)
        # Stamped after append returned: whatever is logged at time s was appended no later than s.
        os.write(fd, f"{time.monotonic():.6f} {total}\\n".encode())
        if mode == "pause" and i == 39:
            os.write(fd, b"PAUSE\\n")
            time.sleep(3600)  # the stream stalls: no token arrives to trigger a write
        time.sleep(0.005)
    """
)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the child did not get there in time"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["stream", "pause"])
def test_kill_9_while_a_reply_streams_loses_at_most_half_a_second(tmp_path: Path, mode: str) -> None:
    db, log = tmp_path / "history.sqlite3", tmp_path / "appended.log"
    script = tmp_path / "streamer.py"
    script.write_text(STREAMER)
    proc = subprocess.Popen([sys.executable, str(script), str(db), str(log), mode])
    try:
        if mode == "stream":
            _wait_for(lambda: log.exists() and log.read_text().count("\n") >= 250)  # > 1 s of tokens
        else:
            _wait_for(lambda: log.exists() and "PAUSE" in log.read_text())
            time.sleep(0.6)  # the pause is older than the 0.5 s bound: its text must all be on disk
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    entries = [line.split() for line in log.read_text().splitlines() if line != "PAUSE"]
    appended = [(float(stamp), int(total)) for stamp, total in entries]
    must_have = max((total for stamp, total in appended if stamp <= killed_at - 0.5), default=0)
    assert must_have > 0
    full = "".join(f"t{i} " for i in range(len(appended)))

    with ChatStore(db) as s:
        msgs = s.messages(s.last_chat_id())
    finished = [(m.role, m.content, m.complete) for m in msgs[:-1]]
    assert finished == [
        ("user", "question 0", True), ("assistant", "answer 0", True),
        ("user", "question 1", True), ("assistant", "answer 1", True),
        ("user", "question 2", True), ("assistant", "answer 2", True),
        ("user", "last question", True),
    ]
    assert [m.stats for m in msgs[:6:2]] == [None] * 3
    assert [m.stats for m in msgs[1:6:2]] == [{"i": i} for i in range(3)]
    partial = msgs[-1]
    assert partial.role == "assistant" and partial.complete is False
    assert full.startswith(partial.content)
    assert len(partial.content) >= must_have, (
        f"on disk {len(partial.content)} chars, but {must_have} had been appended more than 0.5 s before the kill"
    )
    if mode == "pause":
        assert partial.content == full


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


# -- StreamingSaver -------------------------------------------------------------------------------------------
class CountingStore(ChatStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writes: list[tuple[float, str]] = []

    def update_message(self, message_id, content, stats=None, complete=None) -> None:
        super().update_message(message_id, content, stats=stats, complete=complete)
        self.writes.append((time.monotonic(), content))


def test_saver_coalesces_writes_and_flushes_a_paused_stream(tmp_path: Path) -> None:
    with CountingStore(tmp_path / "h.sqlite3") as store:
        chat = store.create_chat("c", "p")
        mid = store.add_message(chat, "assistant", "", complete=False)
        saver = StreamingSaver(store, mid, interval_s=0.2)
        started = time.monotonic()
        for _ in range(300):  # ~0.6 s of fast tokens
            saver.append("x")
            time.sleep(0.002)
        elapsed = time.monotonic() - started
        # Coalesced: about one write per 0.8 * interval_s, not one per token.
        assert 2 <= len(store.writes) <= elapsed / 0.16 + 2
        saver.append("LAST")
        appended_at = time.monotonic()
        time.sleep(0.35)  # no more tokens: the flusher must still save "LAST" within 0.2 s
        assert store.messages(chat)[0].content.endswith("LAST")
        assert store.writes[-1][0] - appended_at <= 0.2
        assert saver.finish(stats={"tokens": 301}) == "x" * 300 + "LAST"
        m = store.messages(chat)[0]
        assert (m.content, m.stats, m.complete) == ("x" * 300 + "LAST", {"tokens": 301}, True)
        with pytest.raises(RuntimeError, match="already finished"):
            saver.append("more")


def test_saver_stop_keeps_partial_reply_incomplete(store: ChatStore) -> None:
    chat = store.create_chat("c", "p")
    mid = store.add_message(chat, "assistant", "", complete=False)
    saver = StreamingSaver(store, mid, initial_text="Hel")
    saver.append("lo")
    saver.finish(complete=False)
    m = store.messages(chat)[0]
    assert (m.content, m.complete, m.stats) == ("Hello", False, None)
    assert saver.finish({"n": 1}, True, text="Hello, world") == "Hello, world"  # the caller's final text wins
    m = store.messages(chat)[0]
    assert (m.content, m.complete, m.stats) == ("Hello, world", True, {"n": 1})
    with pytest.raises(ValueError, match="interval_s"):
        StreamingSaver(store, mid, interval_s=0)


def test_saver_reports_a_failing_store(tmp_path: Path) -> None:
    s = ChatStore(tmp_path / "h.sqlite3")
    chat = s.create_chat("c", "p")
    mid = s.add_message(chat, "assistant", "", complete=False)
    saver = StreamingSaver(s, mid, interval_s=0.05)
    s.close()  # every later write fails
    saver.append("lost?")
    time.sleep(0.2)
    assert isinstance(saver.error, StoreError) and "is closed" in str(saver.error)
    with pytest.raises(StoreError, match="is closed"):
        saver.finish()
