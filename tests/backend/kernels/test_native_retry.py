"""The native library's failure states and its background build (backend/kernels/native_library.py,
native_cache.py; issue 47 class 7, issue 48 item 3): a failed build is retried on a back-off, not never; a
library that fails to load is rebuilt and loaded from a path never loaded before in the process; a first start
builds in the background and :meth:`Library.poll` loads the library once it is installed.

The builder is tests/support/fake_native_builder.py around the small libraries of the ``libraries`` fixture."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

from native_libraries import fake_library

from specchat.backend.kernels import native_cache
from specchat.backend.kernels.native_cache import CacheFolder, Failure
from specchat.backend.kernels.native_library import BUILDING

HOUR = 3600.0


def test_a_failed_build_is_retried_after_its_back_off(libraries, tmp_path):
    good, _, _ = libraries
    first = fake_library(tmp_path, good, "fail")
    reason = first.ensure()
    assert reason is not None and "fake compiler failure" in reason and "tried again after" in reason
    failed = first.folder.failure_record()
    assert failed is not None and failed.count == 1 and failed.identity == first.identity
    # Within the hour: not compiled again, the line says when it will be
    soon = fake_library(tmp_path, good, "ok")
    soon.clock = lambda: time.time() + 0.5 * HOUR
    assert soon.ensure() == reason and "built the library" not in soon.notes
    # After it: built again (here it fails again: two in a row, the next try two hours later)
    later = fake_library(tmp_path, good, "fail")
    later.clock = lambda: time.time() + 1.1 * HOUR
    assert later.ensure() is not None and "built the library" in later.notes
    again = later.folder.failure_record()
    assert again is not None and again.count == 2 and again.retry_at() - again.at == 2 * HOUR
    # ... and once it passes, the build that works is loaded and the note goes
    fixed = fake_library(tmp_path, good, "ok")
    fixed.clock = lambda: time.time() + 3.5 * HOUR
    assert fixed.ensure() is None and fixed.loaded and fixed.folder.failure() is None


def test_another_specchat_or_compiler_retries_at_once(libraries, tmp_path):
    good, _, _ = libraries
    assert fake_library(tmp_path, good, "fail").ensure() is not None
    newer = fake_library(tmp_path, good, "ok")
    newer.identity = "specchat 9.9.9, /usr/bin/c++ g++ 99"
    assert newer.ensure() is None and any("replaces" in note for note in newer.notes)


def test_the_back_off_doubles_up_to_a_day():
    waits = [Failure("x", 0.0, "id", count).retry_at() / HOUR for count in (1, 2, 3, 5, 6, 40)]
    assert waits == [1, 2, 4, 16, 24, 24]
    assert Failure("x", 0.0, "id", 1).due("id", 0.9 * HOUR) is None
    assert Failure("x", 0.0, "id", 1).due("id", 1.0 * HOUR) is not None


def test_an_old_plain_text_note_counts_as_one_failure(tmp_path):
    folder = CacheFolder(tmp_path / "key")
    folder.folder.mkdir()
    folder.failed.write_text("the build failed: c++: error\n")
    record = folder.failure_record()
    assert record is not None and record.reason == "the build failed: c++: error" and record.count == 1


def test_a_forged_library_is_rebuilt_and_loaded_from_a_fresh_path(libraries, tmp_path):
    """A foreign library with a record of its own sha256 checks out and loads, but registers nothing: the rebuilt
    library must then be loaded from another path (the dynamic loader would hand back the foreign one)."""
    good, foreign, marks = libraries
    folder = CacheFolder(tmp_path / "key")
    folder.install(foreign)  # installed with a record that matches it: a forged record
    lib = fake_library(tmp_path, good, "ok")
    paths: list[Path] = []

    def load(path: Path) -> None:
        paths.append(path)
        ctypes.CDLL(str(path)).specchat_fake_good  # noqa: B018 - AttributeError for the foreign library

    lib.load_into_process = load
    assert lib.ensure() is None and lib.loaded
    assert len(paths) == 2 and paths[0] != paths[1] and paths[0] != folder.library != paths[1]
    assert not any(path.exists() for path in paths)  # the staged copies go once mapped
    assert any("did not load" in note for note in lib.notes) and "built the library" in lib.notes


def test_copies_left_by_dead_processes_are_removed(libraries, tmp_path):
    good, _, _ = libraries
    folder = CacheFolder(tmp_path / "key")
    folder.install(good)
    left = folder.folder / "specchat_native.999999.0.so"
    left.write_bytes(b"left by a process that died")
    staged = folder.stage()
    assert not left.exists() and staged.read_bytes() == good.read_bytes() and f".{os.getpid()}." in staged.name


def test_a_copy_that_differs_from_the_record_is_not_staged(libraries, tmp_path):
    good, foreign, _ = libraries
    folder = CacheFolder(tmp_path / "key")
    folder.install(good)
    folder.record.write_text(f"{native_cache.sha256_of(foreign)[0]} {good.stat().st_size}\n")
    try:
        folder.stage()
    except ValueError as error:
        assert "differs" in str(error)
    else:
        raise AssertionError("staged a copy that differs from its record")
    assert not list(folder.folder.glob("specchat_native.*.*.so"))


# -- in the background ---------------------------------------------------------------------------------------


def _poll_until_done(lib, timeout: float = 30.0) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        reason = lib.poll()
        if reason is None or not reason.startswith(BUILDING):
            return reason
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_first_start_builds_in_the_background(libraries, tmp_path):
    good, _, marks = libraries
    lib = fake_library(tmp_path, good, "sleep", FAKE_SLEEP="1")
    before = time.monotonic()
    reason = lib.ensure(wait=False)
    assert time.monotonic() - before < 1.0  # returns at once
    assert reason is not None and reason.startswith(BUILDING) and str(lib.folder.log) in reason
    assert not lib.loaded and lib.poll().startswith(BUILDING)
    assert _poll_until_done(lib) is None and lib.loaded and lib.folder.verified() is None
    assert "good" in marks.read_text().split()


def test_the_background_builder_runs_at_the_lowest_priority(libraries, tmp_path):
    good, _, _ = libraries
    lib = fake_library(tmp_path, good, "sleep", FAKE_SLEEP="2")
    lib.ensure(wait=False)
    assert lib.child is not None
    deadline = time.monotonic() + 10
    while os.getpriority(os.PRIO_PROCESS, lib.child.pid) == os.getpriority(os.PRIO_PROCESS, 0):
        assert time.monotonic() < deadline, "the builder never lowered its priority"
        time.sleep(0.05)
    assert os.getpriority(os.PRIO_PROCESS, lib.child.pid) == 19
    _poll_until_done(lib)


def test_a_background_build_that_fails_says_so(libraries, tmp_path):
    good, _, _ = libraries
    lib = fake_library(tmp_path, good, "fail")
    assert lib.ensure(wait=False).startswith(BUILDING)
    reason = _poll_until_done(lib)
    assert reason is not None and "fake compiler failure" in reason and "tried again after" in reason
    assert lib.poll() == reason  # and stays so for this process


def test_a_crashed_background_builder_is_noted(libraries, tmp_path):
    good, _, _ = libraries
    lib = fake_library(tmp_path, good, "crash")
    lib.ensure(wait=False)
    reason = _poll_until_done(lib)
    assert reason is not None and "status" in reason and lib.folder.failure_record() is not None


def test_one_build_of_the_library_per_process(tmp_path, monkeypatch):
    """A library loaded once is not loaded again from another copy (its classes would register twice, which
    aborts the process); another build is refused with a line saying to restart."""
    from specchat.backend.kernels import native

    copy = tmp_path / "specchat_native.1.0.so"
    copy.write_bytes(b"not a library: loading it would fail")
    monkeypatch.setattr(native, "_in_process", native_cache.sha256_of(copy)[0])
    native.load(copy)  # the same bytes: nothing is loaded
    monkeypatch.setattr(native, "_in_process", "0" * 64)
    try:
        native.load(copy)
    except RuntimeError as error:
        assert "another build" in str(error) and "restart" in str(error)
    else:
        raise AssertionError("loaded a second build into the process")
