"""Read-only and full disks (issue 20 items 4 and 13): a history or settings write on a read-only file, folder or
file system, or on a full disk, keeps the app running, says so once, and loses nothing already saved. Read-only
is decided from the mode bits (the tests run as root, whom modes do not stop), so a 0444 history is opened
read-only and left exactly as it was. Full and read-only file systems use a small tmpfs (skipped, with the
reason, where this machine cannot mount one). Fails on the code before issue 20: the store chmodded a 0444
history to 0600 and a 0555 folder to 0700 and wrote, a full disk repeated its notice at every message, and the
save error blamed permissions."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from specchat.app.chat.conversation import Conversation
from specchat.app.chat.history.export import export_markdown
from specchat.app.chat.history.records import StoreError
from specchat.app.chat.history.store import ChatStore
from specchat.app.chat.settings import Settings, SettingsError, load_settings, save_settings
from specchat.backend.api import RequestStats
from specchat.backend.files import remove_stale_temporaries


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _digest(folder: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), _mode(p)) for p in sorted(folder.iterdir())}


def _saved_history(folder: Path) -> Path:
    db = folder / "history.sqlite3"
    with ChatStore(db) as store:
        chat = store.create_chat("kept", "p")
        store.add_message(chat, "user", "a question")
        store.add_message(chat, "assistant", "an answer", {"tok_s": 3.0})
    return db


def _chat_a_little(store: ChatStore, errors: list[str], turns: int = 3, size: int = 10) -> Conversation:
    conversation = Conversation(store, errors.append)
    conversation.open(store.list_chats()[0].id)
    for turn in range(turns):
        conversation.add_user(f"more {turn} " + "x" * size, "p")
        reply, saver = conversation.start_reply()
        if saver is not None:
            saver.append("y" * size)
        conversation.finish_reply(
            reply, saver, "y" * size, RequestStats(), finish_reason="eos", pair="p", complete=True
        )
    return conversation


# -- read-only by mode bits ----------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_history_is_read_and_left_exactly_as_it_was(tmp_path: Path, what: str) -> None:
    folder = tmp_path / "data"
    db = _saved_history(folder)
    os.chmod(db if what == "file" else folder, 0o444 if what == "file" else 0o555)
    before = _digest(folder)
    try:
        with ChatStore(db) as store:
            assert store.read_only and "read-only" in store.read_only_message and "(mode 0" in store.read_only_message
            assert [m.content for m in store.messages(store.list_chats()[0].id)] == ["a question", "an answer"]
            with pytest.raises(StoreError, match="read-only"):
                store.create_chat("new", "p")
            errors: list[str] = []
            conversation = _chat_a_little(store, errors)
            assert errors == [] and len(conversation.turns) == 8  # said once at start, the chat goes on in memory
        assert _digest(folder) == before and _mode(folder) == (0o700 if what == "file" else 0o555)
    finally:
        os.chmod(folder, 0o700)


def test_an_export_into_a_read_only_folder_is_refused_by_name(tmp_path: Path) -> None:
    with ChatStore(_saved_history(tmp_path / "data")) as store:
        out = tmp_path / "out"
        out.mkdir(mode=0o555)
        try:
            with pytest.raises(StoreError, match=r"could not export the chat to .*read-only \(mode 0555\)"):
                export_markdown(store, store.list_chats()[0].id, out)
            assert list(out.iterdir()) == []
        finally:
            os.chmod(out, 0o700)


def test_a_read_only_folder_without_a_history_disables_history_with_a_notice(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir(mode=0o555)
    try:
        with pytest.raises(StoreError, match=r"cannot create the history file .*read-only \(mode 0555\)"):
            ChatStore(folder / "history.sqlite3")
        assert list(folder.iterdir()) == []
    finally:
        os.chmod(folder, 0o700)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_read_only_settings_are_not_saved_and_say_why(tmp_path: Path, what: str) -> None:
    path = tmp_path / "config" / "settings.json"
    save_settings(Settings(temperature=0.5), path)
    os.chmod(path if what == "file" else path.parent, 0o444 if what == "file" else 0o555)
    before = _digest(path.parent)
    try:
        with pytest.raises(SettingsError, match=r"not saved: .*read-only \(mode 0[45]"):
            save_settings(Settings(temperature=0.9), path)
        assert _digest(path.parent) == before and load_settings(path) == (Settings(temperature=0.5), None)
    finally:
        os.chmod(path.parent, 0o700)


def test_temporary_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".settings.json.{dead.pid}-0a1b2c3d.tmp").write_text("")
    (tmp_path / f".settings.json.{os.getpid()}-0a1b2c3d.tmp").write_text("")
    old = tmp_path / ".settings.json.deadbeef.tmp"  # the old naming, without a pid: removed once an hour old
    old.write_text("{")
    os.utime(old, (0, 0))
    (tmp_path / ".other.json.1-0a1b2c3d.tmp").write_text("")
    assert load_settings(path) == (Settings(), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".other.json.1-0a1b2c3d.tmp",
        f".settings.json.{os.getpid()}-0a1b2c3d.tmp",
    ]
    assert remove_stale_temporaries(tmp_path / "missing-folder" / "x") == 0


# -- full and read-only file systems (tmpfs) -----------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "mnt"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"cannot mount a tmpfs here ({error}): the full-disk tests need root on Linux")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk tests need root on Linux")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 1):  # to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as error:
                assert error.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_keeps_the_chat_going_says_so_once_and_loses_nothing(small_disk: Path) -> None:
    db = _saved_history(small_disk / "data")
    errors: list[str] = []
    with ChatStore(db) as store:
        filler = _fill(small_disk)  # the disk fills during the session
        conversation = _chat_a_little(store, errors, turns=6, size=200_000)  # pages no free block can take
        assert len(errors) == 1 and "disk is full" in errors[0] and "not repeated" in errors[0], errors
        assert len(conversation.turns) == 14
    filler.unlink()
    with ChatStore(db) as store:
        chat = store.list_chats()[0].id
        assert [m.content for m in store.messages(chat)][:2] == ["a question", "an answer"]  # nothing lost
        errors.clear()
        _chat_a_little(store, errors)  # space again: saving works again, silently
        assert errors == [] and len(store.messages(chat)) >= 8


def test_a_start_on_a_full_disk_shows_the_chats_read_only_and_says_why(small_disk: Path) -> None:
    db = _saved_history(small_disk / "data")  # closed cleanly: no -wal / -shm, and no room to create them
    _fill(small_disk)
    with ChatStore(db) as store:
        assert store.read_only and "is full" in store.read_only_message, store.read_only_message
        assert [m.content for m in store.messages(store.list_chats()[0].id)] == ["a question", "an answer"]


def test_settings_on_a_full_disk_keep_the_old_file_and_leave_no_temporary_file(small_disk: Path) -> None:
    path = small_disk / "config" / "settings.json"
    save_settings(Settings(system_prompt="old"), path)
    _fill(small_disk)
    with pytest.raises(SettingsError, match="disk is full") as error:
        save_settings(Settings(system_prompt="new " * 20_000), path)
    assert "permissions" not in str(error.value)
    assert load_settings(path) == (Settings(system_prompt="old"), None)
    assert sorted(p.name for p in path.parent.iterdir()) == ["settings.json"]


def test_a_read_only_file_system_is_read_and_not_written(small_disk: Path) -> None:
    db = _saved_history(small_disk / "data")
    save_settings(Settings(top_k=3), small_disk / "settings.json")
    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, text=True)
    if remount.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {remount.stderr.strip()}")
    with ChatStore(db) as store:
        assert store.read_only and "mounted read-only" in store.read_only_message
        assert len(store.messages(store.list_chats()[0].id)) == 2
    with pytest.raises(SettingsError, match="mounted read-only"):
        save_settings(Settings(top_k=4), small_disk / "settings.json")
    assert load_settings(small_disk / "settings.json") == (Settings(top_k=3), None)
