"""The native library's cache folder: who builds it (a lock naming the builder's pid), what was built (a sha256
record), why a build failed (a note), and the check made before anything is loaded. No torch, no compiler here:
``native_build.py`` compiles and loads; this module only decides what the files on disk may be trusted for.

One folder per build key (``native_build.build_key``: sources, flags, torch, compiler, platform):

    <root>/<key>/specchat_native.so          the library, installed by an atomic rename
    <root>/<key>/specchat_native.so.sha256   "<sha256> <size>" of it, written by the build that made it
    <root>/<key>/builder.lock                flock'ed by the process building it, its pid inside
    <root>/<key>/failed                      why the last build failed, when, by which specchat and compiler,
                                             and how many times in a row (JSON: :class:`Failure`)
    <root>/<key>/build.log                   the last build's compiler output
    <root>/<key>/build/                      torch.utils.cpp_extension's build folder (ninja, objects, its ``lock``)

Contract:
- :meth:`CacheFolder.verified` is True only when the library's bytes hash to the record written by the build
  that installed it: a truncated, corrupted or foreign file (another valid library placed under the name), or
  a missing record, is never handed to the dynamic loader, so none of its code (constructors included) runs.
- :meth:`CacheFolder.take_lock` takes the build lock, or names the live process that holds it (its pid). A
  builder killed mid-build holds nothing (the kernel drops its flock) and leaves its pid in the lock file: the
  next builder finds it there and removes what it left, cpp_extension's own lock file and half-built objects
  included, so a killed build never blocks or spoils a later one.
- :meth:`CacheFolder.install` moves a freshly built file into place: record first (as a temporary file, then
  renamed), the library last, so a reader never sees a new library without its record.
- A failed build is retried with a back-off (:meth:`Failure.due`): at once under a new specchat version or
  another compiler, else 1 hour after the first failure, doubling up to a day.
- :meth:`CacheFolder.stage` copies the verified library to a name no load in any process used before
  (``specchat_native.<pid>.<n>.so``; the copy's bytes checked against the record): the dynamic loader keys what
  it loaded by path, so a library rebuilt after a failed load is never the same path loaded again.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl

    HAS_FCNTL = True
except ImportError:  # not POSIX: native_build.unavailable() says the library is not built there
    HAS_FCNTL = False

LIBRARY = "specchat_native.so"
_READ = 1 << 20
FIRST_RETRY_S = 3600.0  # a failed build is tried again after an hour, then 2, 4, ... hours
LAST_RETRY_S = 24 * 3600.0  # at most a day apart
_staged = itertools.count()


def sha256_of(path: Path) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of ``path``, streamed."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


@dataclass(frozen=True)
class Failure:
    """A failed build as ``failed`` records it."""

    reason: str
    at: float  # when (seconds since the epoch)
    identity: str  # the specchat version and compiler that failed (native_build.identity)
    count: int  # failures in a row

    def retry_at(self) -> float:
        return self.at + min(LAST_RETRY_S, FIRST_RETRY_S * 2.0 ** min(max(self.count - 1, 0), 30))

    def due(self, identity: str, now: float) -> str | None:
        """Why a new build is due now (another specchat or compiler, or the back-off has passed), or None."""
        if identity != self.identity:
            return f"{identity} replaces {self.identity or 'the one that failed'}"
        if now >= self.retry_at():
            return f"{self.count} failed build(s), the last {(now - self.at) / 3600:.1f} h ago"
        return None

    def when_retried(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.retry_at()))


@dataclass(frozen=True)
class Holder:
    """The process holding a build lock."""

    pid: int  # -1: not known (the holder has not written it yet)

    def __str__(self) -> str:
        return f"process {self.pid}"


class CacheFolder:
    """One build key's folder (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.library = self.folder / LIBRARY
        self.record = self.folder / (LIBRARY + ".sha256")
        self.lock = self.folder / "builder.lock"
        self.failed = self.folder / "failed"
        self.log = self.folder / "build.log"
        self.build = self.folder / "build"

    # -- integrity -----------------------------------------------------------------------------------------

    def recorded(self) -> tuple[str, int] | None:
        """The (sha256, size) its build wrote, or None (no record, or not one this module writes)."""
        try:
            digest, size = self.record.read_text(encoding="ascii").split()
            if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
                return digest, int(size)
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        return None

    def verified(self) -> str | None:
        """None when the installed library is exactly what its build recorded; else why not (it is then not to
        be loaded). Reads the file, never loads it."""
        record = self.recorded()
        if not self.library.exists() and not self.library.is_symlink():
            return "not built yet"
        if not self.library.is_file() or self.library.is_symlink():
            return "it is not a plain file"
        if record is None:
            return f"{self.record.name} is missing or unreadable"
        try:
            if self.library.stat().st_size != record[1]:
                return f"its size is {self.library.stat().st_size} bytes, the build recorded {record[1]} (truncated?)"
            digest, _ = sha256_of(self.library)
        except OSError as error:
            return f"it cannot be read ({error.strerror or error})"
        if digest != record[0]:
            return "its sha256 differs from the one its build recorded (damaged, or replaced by another file)"
        return None

    def discard(self) -> None:
        """Remove the installed library and its record (a damaged or foreign one, whatever it is: a file, a link,
        a folder), so it is built again. OSError when they cannot be removed."""
        for path in (self.library, self.record):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def stage(self) -> Path:
        """A copy of the verified library under a name never loaded before (see the module docstring), its bytes
        checked against the record; the caller loads it and removes it (a mapped library needs no file). Copies
        left by processes that died before removing theirs are removed. OSError / ValueError when it cannot."""
        for left in self.folder.glob("specchat_native.*.*.so"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(left.name.split(".")[1])
                if pid != os.getpid() and not _alive(pid):
                    left.unlink()
        record = self.recorded()
        if record is None:
            raise ValueError(f"{self.record.name} is missing or unreadable")
        staged = self.folder / f"specchat_native.{os.getpid()}.{next(_staged)}.so"
        shutil.copyfile(self.library, staged)
        if sha256_of(staged) != record:
            staged.unlink()
            raise ValueError("the copy to load differs from the build's record (the library changed meanwhile)")
        return staged

    def install(self, built: Path) -> str:
        """Copy ``built`` into place with its record (see the module docstring); returns its sha256."""
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f".{LIBRARY}.{os.getpid()}.partial"
        shutil.copyfile(built, partial)
        digest, size = sha256_of(partial)
        record = self.folder / f".{self.record.name}.{os.getpid()}.partial"
        record.write_text(f"{digest} {size}\n", encoding="ascii")
        os.replace(record, self.record)
        os.replace(partial, self.library)
        return digest

    # -- failures ------------------------------------------------------------------------------------------

    def failure(self) -> str | None:
        """The reason a build of this key failed before, if it did."""
        record = self.failure_record()
        return None if record is None else record.reason

    def failure_record(self) -> Failure | None:
        """The last failure (an older plain-text note counts as one failure, at the file's time)."""
        try:
            text = self.failed.read_text(encoding="utf-8").strip()
            at = self.failed.stat().st_mtime
        except (OSError, UnicodeDecodeError):
            return None
        try:
            data = json.loads(text)
            return Failure(str(data["reason"]), float(data["at"]), str(data["identity"]), max(int(data["count"]), 1))
        except (ValueError, KeyError, TypeError):
            return Failure(text or "an earlier build failed", at, "", 1)

    def note_failure(self, reason: str, identity: str, now: float | None = None) -> None:
        """Record a failure (one more in a row when the last one was by the same specchat and compiler)."""
        previous = self.failure_record()
        count = previous.count + 1 if previous is not None and previous.identity == identity else 1
        data = {"reason": reason, "at": time.time() if now is None else now, "identity": identity, "count": count}
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = self.folder / f".failed.{os.getpid()}.partial"
            partial.write_text(json.dumps(data) + "\n", encoding="utf-8")
            os.replace(partial, self.failed)

    def clear_failure(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.failed.unlink()

    # -- the build lock ------------------------------------------------------------------------------------
    # An flock on builder.lock: the kernel releases it when its process dies, however it dies, so a killed
    # builder never blocks anyone. The file keeps the holder's pid while it builds and is
    # emptied when a build ends; finding a pid in it on taking the lock means that builder died mid-build.

    def holder(self) -> Holder | None:
        """The live process holding the build lock, or None."""
        try:
            fd = os.open(self.lock, os.O_RDONLY)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return self._named(fd) or Holder(-1)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    @staticmethod
    def _named(fd: int) -> Holder | None:
        try:
            return Holder(int(os.pread(fd, 100, 0).decode("ascii").strip()))
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    def take_lock(self) -> Holder | None:
        """Take the build lock for this process: None when taken, else the live process holding it. When the
        previous holder died mid-build (its pid is still written in the lock file, see above) what it left is
        cleared first (:meth:`clear_stale`)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self._named(fd) or Holder(-1)
            os.close(fd)
            return holder
        dead = self._named(fd)
        if dead is not None and dead.pid != os.getpid():
            self.clear_stale()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd: int | None = fd
        return None

    def clear_stale(self) -> None:
        """What a builder that died mid-build left: cpp_extension's lock file (its FileBaton would make every
        later build wait for it forever), its build folder (objects it may have left half-written) and partial
        files. Called only with the build lock held."""
        shutil.rmtree(self.build, ignore_errors=True)
        for partial in self.folder.glob(".*.partial"):
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()

    def release_lock(self) -> None:
        """End a build: empty the lock file (a clean end), then let go of it."""
        fd = getattr(self, "_fd", None)
        if fd is None:
            return
        self._fd = None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)

    def wipe(self) -> None:
        """Everything of this key (``specchat doctor --rebuild-native``), except a live builder's lock."""
        if self.holder() is None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
