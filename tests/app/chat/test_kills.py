"""``kill -9`` at random moments (issue 20): of a process streaming replies into the history through the
StreamingSaver, and of one saving the settings over and over. After each kill: the database passes
``PRAGMA integrity_check``, every message the process reported committed is there whole, the reply being streamed
is a prefix of what was appended (never a torn piece), the settings file holds one whole save (the last reported
or the one in flight), no temporary file is left, and the next start opens both without a recovery notice or a
warning. 10 kills of each kind in the default run, 100 under ``pytest -m soak``. Fails on the code before issue 20:
a killed settings save left its temporary file behind for good (nothing removed it)."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from reliability import KILLS, SCALES, SURVIVED

from specchat.app.chat.history.store import ChatStore
from specchat.app.chat.settings import load_settings

SAVER_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from specchat.app.chat.history.saver import StreamingSaver
    from specchat.app.chat.history.store import ChatStore
    store = ChatStore(Path(sys.argv[1]))
    chat = store.create_chat("killed", "p")
    print("ready", chat, flush=True)
    for turn in range(10**6):
        uid = store.add_message(chat, "user", f"question {turn} " + "q" * (turn * 37 % 2000))
        print("user", uid, turn, flush=True)
        mid = store.add_message(chat, "assistant", "", None, False)
        print("reply", mid, turn, flush=True)
        saver = StreamingSaver(store, mid, interval_s=0.02)
        for i in range(1 + turn * 53 % 300):
            saver.append(f"t{turn}.{i} ")
            if i % 25 == 0:
                time.sleep(0.002)
        saver.finish({"turn": turn}, True)
        print("done", mid, turn, flush=True)
    """
)
SETTINGS_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from specchat.app.chat.settings import Settings, save_settings
    path = Path(sys.argv[1])
    print("ready", flush=True)
    for i in range(10**6):
        save_settings(Settings(system_prompt=f"{i}:" + "x" * (i * 7919 % 150_000), top_k=i), path)
        print("saved", i, flush=True)
    """
)


def _reply(turn: int) -> list[str]:
    return [f"t{turn}.{i} " for i in range(1 + turn * 53 % 300)]


def _kill_at_random(script: Path, target: Path, rng: random.Random) -> list[list[str]]:
    """Start the child, kill -9 it 0.02-0.6 s after it is ready; its reported lines."""
    child = subprocess.Popen(
        [sys.executable, str(script), str(target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    first = child.stdout.readline()
    assert first.startswith("ready"), first + child.stderr.read()
    time.sleep(rng.uniform(0.02, 0.6))
    os.kill(child.pid, signal.SIGKILL)
    out, err = child.communicate(timeout=60)  # reaped: its pid is gone
    assert child.returncode == -signal.SIGKILL, err
    # a line the kill cut short (no newline yet: print() may hand "saved", " ", "5" to the pipe apart) is no report
    whole = [line for line in [first, *out.splitlines(keepends=True)] if line.endswith("\n")]
    return [line.split() for line in whole if line.strip()]


def _check_history(db: Path, lines: list[list[str]]) -> None:
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        raw.close()
    with ChatStore(db) as store:  # the next start: no recovery, no prompt
        assert store.recovery_message is None and not store.read_only
        chat = int(lines[0][1])
        stored = {m.id: m for m in store.messages(chat)}
        for kind, message_id, turn in lines[1:]:
            message, n = stored[int(message_id)], int(turn)  # every committed message is there
            if kind == "user":
                assert message.content == f"question {n} " + "q" * (n * 37 % 2000)
            elif kind == "done":
                assert message.complete and message.content == "".join(_reply(n)) and message.stats == {"turn": n}
            else:  # the reply streaming at the kill (or finished just before it): whole pieces, in order
                pieces = _reply(n)
                assert any(message.content == "".join(pieces[:k]) for k in range(len(pieces) + 1)), message.content
        store.add_message(chat, "user", "after the kill")  # and it takes new writes


def _check_settings(path: Path, lines: list[list[str]]) -> None:
    saved = [int(line[1]) for line in lines if line[0] == "saved"]
    settings, warning = load_settings(path)  # the next start: removes the killed save's temporary file
    assert warning is None, warning
    if path.exists():
        index = int(settings.system_prompt.split(":")[0])
        assert index in ((saved[-1], saved[-1] + 1) if saved else (0,)), (index, saved[-3:])
        assert settings.system_prompt == f"{index}:" + "x" * (index * 7919 % 150_000) and settings.top_k == index
    else:
        assert not saved
    assert [p.name for p in path.parent.iterdir()] == ([path.name] if path.exists() else [])


@SCALES
def test_kill_9_while_a_reply_streams_into_the_history(tmp_path: Path, scale: int) -> None:
    script = tmp_path / "saver_child.py"
    script.write_text(SAVER_CHILD)
    rng = random.Random()
    for kill in range(10 * scale):
        db = tmp_path / f"run{kill}" / "history.sqlite3"
        lines = _kill_at_random(script, db, rng)
        KILLS["a streaming reply (history saver)"] += 1
        _check_history(db, lines)
        SURVIVED["a streaming reply (history saver)"] += 1


@SCALES
def test_kill_9_while_the_settings_are_saved(tmp_path: Path, scale: int) -> None:
    script = tmp_path / "settings_child.py"
    script.write_text(SETTINGS_CHILD)
    rng = random.Random()
    for kill in range(10 * scale):
        path = tmp_path / f"run{kill}" / "settings.json"
        lines = _kill_at_random(script, path, rng)
        KILLS["a settings save"] += 1
        _check_settings(path, lines)
        SURVIVED["a settings save"] += 1
