"""The one atomic file write (backend/files.py): content replaced whole, permission bits kept or set, data and
folder fsynced around the rename, and no temporary file left behind by any failure; plus the backend caller's own
error (the converted-model hash cache)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from specchat.backend import files
from specchat.backend.errors import ModelLoadError
from specchat.backend.files import write_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_new_file_gets_the_content_and_the_umask_mode(tmp_path: Path, umask_022: None) -> None:
    target = tmp_path / "new.txt"
    write_atomic(target, "héllo\r\nwörld")
    assert target.read_bytes() == "héllo\r\nwörld".encode()  # UTF-8, line ends untouched
    assert _mode(target) == 0o644
    write_atomic(tmp_path / "raw.bin", b"\x00\xff")
    assert (tmp_path / "raw.bin").read_bytes() == b"\x00\xff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.txt", "raw.bin"]


def test_the_content_is_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    target.write_text("x" * 10_000)
    write_atomic(target, "short")
    assert target.read_text() == "short"
    write_atomic(target, b"")
    assert target.read_bytes() == b""
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_an_existing_files_mode_is_kept_and_an_explicit_mode_is_set_exactly(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_text("old")
    os.chmod(target, 0o640)
    write_atomic(target, "new")
    assert (target.read_text(), _mode(target)) == ("new", 0o640)
    old_umask = os.umask(0o077)  # a restrictive umask must not strip the bits asked for
    try:
        write_atomic(target, "newer", mode=0o664)
        assert _mode(target) == 0o664
        write_atomic(tmp_path / "private.json", "{}", mode=0o600)
        assert _mode(tmp_path / "private.json") == 0o600
    finally:
        os.umask(old_umask)


def test_a_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    real, link = tmp_path / "real.txt", tmp_path / "link.txt"
    real.write_text("real")
    link.symlink_to(real)
    write_atomic(link, "new")
    assert not link.is_symlink() and link.read_text() == "new" and real.read_text() == "real"


def test_the_data_is_fsynced_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_atomic(tmp_path / "f.txt", "data")
    assert events == ["fsync file", "replace", "fsync folder"]


def test_a_folder_that_cannot_be_fsynced_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(tmp_path / "f.txt", "data")
    assert (tmp_path / "f.txt").read_text() == "data"


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_a_failure_leaves_the_old_file_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    target = tmp_path / "settings.json"
    target.write_text("old")

    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "new" * 1000)
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]  # the temporary file is gone


def test_an_interruption_mid_write_removes_the_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(fd: int, data) -> int:
        os.ftruncate(fd, 0)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "f.txt", "data")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_raises_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no-such-dir" / "f.txt", "data")
    assert list(tmp_path.iterdir()) == []


def test_a_taken_temporary_name_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = iter([b"\x00" * 4, b"\x00" * 4, b"\x01" * 4])
    monkeypatch.setattr(files.os, "urandom", lambda n: next(names))
    (tmp_path / ".f.txt.00000000.tmp").write_text("another writer's")
    write_atomic(tmp_path / "f.txt", "data")
    assert (tmp_path / "f.txt").read_text() == "data"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".f.txt.00000000.tmp", "f.txt"]


def test_the_hash_cache_write_failure_is_a_model_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specchat.backend.models.gguf import convert

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(cache))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "hashes.json":
            raise PermissionError(errno.EACCES, "Permission denied")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(
        ModelLoadError,
        match=r"cannot write the hash cache .*hashes\.json: Permission denied.*"
        r"SPECCHAT_CACHE_DIR",
    ):
        convert.file_sha256(model)
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(os, "replace", real_replace)
    assert convert.file_sha256(model) == convert.file_sha256(model)
    assert [p.name for p in cache.iterdir()] == ["hashes.json"]
