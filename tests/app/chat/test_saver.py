"""Saving a reply while it streams (app/chat/history/saver.py): kill -9 mid-stream loses at most half a second,
writes are coalesced, a paused stream is still flushed, a stopped reply stays incomplete, store failures surface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specchat.app.chat.history.records import StoreError
from specchat.app.chat.history.saver import StreamingSaver
from specchat.app.chat.history.store import ChatStore

# -- kill -9 while a reply streams ----------------------------------------------------------------------------
STREAMER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from specchat.app.chat.history.saver import StreamingSaver
    from specchat.app.chat.history.store import ChatStore
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
        ("user", "question 0", True),
        ("assistant", "answer 0", True),
        ("user", "question 1", True),
        ("assistant", "answer 1", True),
        ("user", "question 2", True),
        ("assistant", "answer 2", True),
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
