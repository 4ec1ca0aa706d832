"""The native library's cache under fault injection (backend/kernels/native_build.py, native_cache.py): damaged and
foreign cached libraries, builders killed mid-build, failed and crashed builds, a busy lock, no compiler. Every
case ends in a rebuild or in one clear line naming the log, and no foreign library is ever loaded (its
constructor would leave a mark).

The builder here is tests/support/fake_native_builder.py: the real lock, install and failure handling around a
"compile" that copies a small C library built once for the module, so each case takes a fraction of a second.
tests/backend/kernels/test_native_model.py and the slow tests run the real build."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from native_libraries import BUILDER, fake_library

from specchat.backend.kernels import native, native_build, native_library
from specchat.backend.kernels.native_cache import CacheFolder

_library = fake_library  # the fixture `libraries` (conftest.py) makes what it copies


def _marks(marks: Path) -> list[str]:
    return marks.read_text().split() if marks.exists() else []


def _installed(root: Path, good: Path) -> native_library.Library:
    """A library built and installed, not loaded: the damage below rewrites files in place, and a library this
    process had mapped would then crash it (as it would any process running it: why installs use a rename)."""
    lib = _library(root, good)
    lib.load_into_process = lambda path: None
    assert lib.ensure() is None and lib.folder.verified() is None
    return lib


# -- damaged and foreign cached libraries: 24 kinds of damage x 2 = 48 cases ---------------------------------


def _flip(at: float):
    def damage(folder: CacheFolder, foreign: Path) -> None:
        data = bytearray(folder.library.read_bytes())
        data[min(len(data) - 1, int(len(data) * at))] ^= 0xFF
        folder.library.write_bytes(bytes(data))

    return damage


def _truncate(keep: float):
    def damage(folder: CacheFolder, foreign: Path) -> None:
        data = folder.library.read_bytes()
        folder.library.write_bytes(data[: int(len(data) * keep)])

    return damage


def _foreign(folder: CacheFolder, foreign: Path) -> None:
    shutil.copyfile(foreign, folder.library)


def _foreign_same_size(folder: CacheFolder, foreign: Path) -> None:
    data, size = foreign.read_bytes(), folder.library.stat().st_size
    folder.library.write_bytes((data + b"\0" * size)[: max(size, len(data))])


def _foreign_link(folder: CacheFolder, foreign: Path) -> None:
    folder.library.unlink()
    folder.library.symlink_to(foreign)


def _record(text: str):
    def damage(folder: CacheFolder, foreign: Path) -> None:
        folder.record.write_text(text)

    return damage


DAMAGE = {
    "empty": _truncate(0.0),
    "first-byte": _truncate(1 / 4096),
    "half": _truncate(0.5),
    "one-byte-short": _truncate(0.9999),
    "elf-magic": _flip(0.0),
    "header": _flip(0.01),
    "middle": _flip(0.5),
    "last-byte": _flip(1.0),
    "appended": lambda f, _: f.library.write_bytes(f.library.read_bytes() + b"garbage"),
    "garbage": lambda f, _: f.library.write_bytes(os.urandom(f.library.stat().st_size)),
    "text": lambda f, _: f.library.write_text("not a library\n"),
    "foreign": _foreign,
    "foreign-padded": _foreign_same_size,
    "foreign-symlink": _foreign_link,
    "directory": lambda f, _: (f.library.unlink(), f.library.mkdir()),
    "record-missing": lambda f, _: f.record.unlink(),
    "record-empty": _record(""),
    "record-garbage": _record("zzz 12\n"),
    "record-other-file": _record(f"{'0' * 64} 12\n"),
    "record-binary": lambda f, _: f.record.write_bytes(os.urandom(80)),
    "library-missing": lambda f, _: f.library.unlink(),
    "both-missing": lambda f, _: (f.library.unlink(), f.record.unlink()),
    "foreign-with-its-size": lambda f, foreign: (
        _foreign(f, foreign),
        f.record.write_text(f"{'1' * 64} {foreign.stat().st_size}\n"),
    ),
    "lock-left-by-dead-builder": lambda f, _: (f.lock.write_text("999999\n"), _truncate(0.5)(f, _)),
}


@pytest.mark.parametrize("then", ["rebuilds", "build-fails"])
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_or_foreign_library_is_never_loaded(kind, then, libraries, tmp_path):
    good, foreign, marks = libraries
    _installed(tmp_path, good)
    before = _marks(marks)
    DAMAGE[kind](CacheFolder(tmp_path / "key"), foreign)
    lib = _library(tmp_path, good, "ok" if then == "rebuilds" else "fail")
    reason = lib.ensure()
    assert "foreign" not in _marks(marks)[len(before) :]  # no constructor of a file that did not check out ran
    if then == "rebuilds":
        assert reason is None and lib.folder.verified() is None
        assert lib.notes and lib.notes[-1] == "built the library"
    else:
        assert reason is not None and "\n" not in reason and str(lib.folder.log) in reason
        assert "fake compiler failure" in reason
        assert not lib.folder.library.exists() or lib.folder.verified() is not None
        # The failure is noted: the next start does not compile again with the same sources and compiler ...
        again = _library(tmp_path, good, "ok")
        assert again.ensure() == reason and "built the library" not in again.notes
        # ... until someone asks (specchat doctor --rebuild-native)
        assert again.rebuild() is None and again.folder.verified() is None


def test_a_library_that_does_not_load_is_rebuilt_once(libraries, tmp_path):
    good, _, _ = libraries
    lib = _installed(tmp_path, good)
    calls = []

    def refuse(path: Path) -> None:
        calls.append(path)
        raise OSError("undefined symbol: _ZN3fooEv")

    lib = _library(tmp_path, good)
    lib.load_into_process = refuse
    reason = lib.ensure()
    assert len(calls) == 2 and reason is not None and "does not load" in reason and "undefined symbol" in reason
    assert "\n" not in reason and str(lib.folder.log) in reason


# -- builders that die, locks that are left, builds that hang ----------------------------------------------


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM])
def test_a_builder_killed_mid_build_blocks_nothing(signal_number, libraries, tmp_path):
    good, _, _ = libraries
    folder = CacheFolder(tmp_path / "key")
    folder.folder.mkdir(parents=True)
    env = {**os.environ, "FAKE_LIBRARY": str(good), "FAKE_BUILD": "sleep", "FAKE_SLEEP": "60"}
    child = subprocess.Popen([sys.executable, str(BUILDER), str(folder.folder)], env=env)
    _wait_for(lambda: folder.holder() is not None and folder.holder().pid == child.pid)
    folder.build.mkdir(exist_ok=True)
    (folder.build / "lock").write_text("")  # cpp_extension's FileBaton, as a killed build leaves it
    (folder.folder / f".specchat_native.so.{child.pid}.partial").write_bytes(b"half")
    child.send_signal(signal_number)
    child.wait()
    started = time.monotonic()
    lib = _library(tmp_path, good)
    assert lib.ensure() is None and lib.folder.verified() is None
    assert time.monotonic() - started < 20
    assert not (folder.build / "lock").exists() and not list(folder.folder.glob(".*.partial"))


def test_a_live_builder_is_waited_for_not_duplicated(libraries, tmp_path):
    good, _, marks = libraries
    folder = CacheFolder(tmp_path / "key")
    folder.folder.mkdir(parents=True)
    env = {**os.environ, "FAKE_LIBRARY": str(good), "FAKE_BUILD": "sleep", "FAKE_SLEEP": "2"}
    child = subprocess.Popen([sys.executable, str(BUILDER), str(folder.folder)], env=env)
    _wait_for(lambda: folder.holder() is not None)
    seen = []
    lib = _library(tmp_path, good, "fail")  # a second compile would fail: it must not run
    assert lib.ensure(lambda text, fraction: seen.append(text)) is None
    child.wait()
    assert any("another specchat process" in text for text in seen) and "built the library" not in lib.notes


def test_a_crashed_builder_is_a_clear_line(libraries, tmp_path):
    good, _, _ = libraries
    lib = _library(tmp_path, good, "crash")
    reason = lib.ensure()
    assert reason is not None and "\n" not in reason and "status" in reason and str(lib.folder.log) in reason
    assert lib.folder.holder() is None  # the kernel dropped its lock


def test_a_hanging_build_is_stopped(libraries, tmp_path):
    good, _, _ = libraries
    lib = _library(tmp_path, good, "sleep", FAKE_SLEEP="60")
    lib.timeout_s = 1.5
    started = time.monotonic()
    reason = lib.ensure()
    assert reason is not None and "longer than" in reason and time.monotonic() - started < 15


def test_progress_names_the_one_time_compile(libraries, tmp_path):
    good, _, _ = libraries
    seen = []
    lib = _library(tmp_path, good, "sleep", FAKE_SLEEP="1.2")
    assert lib.ensure(lambda text, fraction: seen.append(text)) is None
    assert seen and all(native_build.COMPILING in text for text in seen) and lib.built_s is not None


# -- what decides a new build: sources, compiler, flags ----------------------------------------------------


def test_the_key_follows_sources_and_compiler(tmp_path, monkeypatch):
    cxx = native_build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    first = native_build.build_key(cxx)
    copy = tmp_path / "csrc"
    shutil.copytree(native_build.CSRC, copy)
    monkeypatch.setattr(native_build, "CSRC", copy)
    assert native_build.build_key(cxx) == first
    (copy / "model.h").write_text((copy / "model.h").read_text() + "\n// changed\n")
    changed_source = native_build.build_key(cxx)
    monkeypatch.setitem(native_build._VERSIONS, cxx, "g++ (Debian) 99.0")
    assert len({first, changed_source, native_build.build_key(cxx)}) == 3


def test_no_compiler_is_a_clear_reason(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native_build.unavailable() == "no C++ compiler found (install g++ or clang++, or set CXX)"
    assert native.ensure() == native_build.unavailable()
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")
    assert native.ensure() == "turned off (SPECCHAT_NATIVE=0)"
