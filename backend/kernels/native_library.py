"""The native library of one build key as this process sees it: built (in the foreground, or in the background
while the replies run on a slower path), checked and loaded (``native_build.py`` compiles, ``native_cache.py``
decides what the files on disk may be trusted for, ``native.py`` holds the process's instance).

Contract:
- :meth:`Library.ensure(progress, wait=True)` returns None once the library is loaded in this process, else the
  one-line reason it is not (naming the build log). A cached library is loaded only after its bytes match its
  build's record, from a fresh copy (``CacheFolder.stage``: never a path this process loaded before); a
  mismatch, or a load that fails, discards it and builds it once more. A failed build is retried when its
  back-off says so (``native_cache.Failure.due``: another specchat or compiler at once, else 1 h, 2 h, ... up
  to a day), and the reason says when. With ``wait=False`` a build that is needed starts in the background
  at the lowest CPU priority (niceness 19, inherited by the compilers it starts) and :data:`BUILDING` begins
  the returned reason;
  :meth:`poll` then says how it goes and loads the library once it is installed (None).
- :meth:`rebuild` (``specchat doctor --rebuild-native``) forgets the key's library and failure note and builds
  in the foreground.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from specchat.backend.kernels import native_build
from specchat.backend.kernels.native_build import BUILD_TIMEOUT_S, BUSY_EXIT, COMPILING, Progress
from specchat.backend.kernels.native_cache import CacheFolder

BUILDING = "the CPU kernels are being built in the background"


class Library:
    """One library's cache folder, how to build it, and how to load and check it (``native.py`` holds the
    process's instance; tests make their own with a fast builder)."""

    def __init__(
        self,
        folder: CacheFolder,
        command: list[str],
        *,
        load: Callable[[Path], None],
        env: dict[str, str] | None = None,
        timeout_s: float = BUILD_TIMEOUT_S,
        identity: str | None = None,
    ) -> None:
        self.folder, self.command, self.load_into_process, self.env = folder, command, load, env
        self.timeout_s = timeout_s
        self.identity = native_build.identity() if identity is None else identity
        self.clock: Callable[[], float] = time.time  # the back-off's clock (tests move it)
        self.loaded = False
        self.built_s: float | None = None  # how long this process's build took (None: none ran)
        self.notes: list[str] = []  # what happened (discarded a damaged library, rebuilt, ...), for doctor
        self.child: subprocess.Popen[bytes] | None = None  # a build running in the background
        self.started = 0.0
        self.started_wall = 0.0
        self.loads_left = 2  # loads this process may still try (the first, and one after a rebuild)

    def _why(self, what: str) -> str:
        return f"{what} (log: {self.folder.log})"

    def _failed(self, failure: str) -> str:
        return self._why(f"{failure}; `specchat doctor --rebuild-native` tries again")

    def ensure(self, progress: Progress | None = None, *, retries: int = 1, wait: bool = True) -> str | None:
        """None once loaded; else the one-line reason (see the module docstring)."""
        if self.loaded:
            return None
        self.loads_left = retries + 1
        try:
            return self._ensure(progress, wait)
        except OSError as error:  # a cache folder that cannot be written or read: say where
            return self._why(_cannot_use(error))

    def _ensure(self, progress: Progress | None, wait: bool) -> str | None:
        while True:
            damaged = self.folder.verified()
            if damaged is not None and damaged != "not built yet":
                self.notes.append(f"discarded the cached library: {damaged}")
                self.folder.discard()
            if not self.folder.library.exists():
                held = self._held_back()
                if held is not None:
                    return held
                if not wait:
                    return self._start_background()
                failed = self.build(progress)
                if failed is not None:
                    return failed
                damaged = self.folder.verified()
                if damaged is not None:
                    self.folder.discard()
                    return self._why(f"the library just built does not check out: {damaged}")
            failed = self._load()
            if failed is None or self.loads_left <= 0:
                return failed

    def _held_back(self) -> str | None:
        """The reason not to build now: a failure whose back-off has not passed (None: build)."""
        failed = self.folder.failure_record()
        if failed is None or self.folder.holder() is not None:
            return None
        due = failed.due(self.identity, self.clock())
        if due is None:
            return self._noted()
        self.notes.append(f"building again: {due}")
        return None

    def _noted(self) -> str:
        """The line for the failure ``failed`` records: what failed, and when a start tries again."""
        failed = self.folder.failure_record()
        if failed is None:
            return self._failed("the build failed")
        again = f"tried again after {failed.when_retried()}, or now with `specchat doctor --rebuild-native`"
        return self._why(f"{failed.reason}; {again}")

    def _load(self) -> str | None:
        """Load the installed library from a fresh copy; None when loaded, else why (discarded for a rebuild)."""
        self.loads_left -= 1
        staged: Path | None = None
        try:
            staged = self.folder.stage()
            self.load_into_process(staged)
        except Exception as error:  # noqa: BLE001 - a library that does not load is rebuilt once
            reason = " ".join(str(error).split())[:300] or type(error).__name__
            self.notes.append(f"the cached library did not load ({reason})")
            self.folder.discard()
            if self.loads_left > 0:
                return self._failed(f"the library built but does not load: {reason}")
            self.folder.note_failure(f"the library built but does not load: {reason}", self.identity, self.clock())
            return self._noted()
        finally:
            if staged is not None:
                with contextlib.suppress(OSError):
                    staged.unlink()  # mapped now (or refused): the file is not needed
        self.loaded = True
        return None

    # -- in the background ---------------------------------------------------------------------------------

    def _start_background(self) -> str:
        holder = self.folder.holder()
        if holder is None:
            self.notes.append("built the library in the background")
            self.started = time.monotonic()
            self.child = self._spawn()
            with contextlib.suppress(OSError):  # the replies meanwhile keep the cores; its compilers inherit it
                os.setpriority(os.PRIO_PROCESS, self.child.pid, 19)
        return self._building()

    def _building(self) -> str:
        step = _last_step(self.folder.log)
        where = f", step {step[0]} of {step[1]}" if step else ""
        holder = self.folder.holder()
        who = f" by {holder}" if holder is not None and (self.child is None or holder.pid != self.child.pid) else ""
        return self._why(f"{BUILDING}{who} ({time.monotonic() - self.started:.0f} s{where})")

    def poll(self) -> str | None:
        """After ``ensure(wait=False)``: None once the library is loaded (loading it when a background build has
        installed it), else the reason (still building, or why it failed)."""
        if self.loaded:
            return None
        try:
            if self.child is not None:
                status = self.child.poll()
                if status is None and time.monotonic() - self.started > self.timeout_s:
                    os.killpg(self.child.pid, 9)
                    status = self.child.wait()
                if status is None:
                    return self._building()
                self.child, self.built_s = None, time.monotonic() - self.started
                if status not in (0, BUSY_EXIT) and self.folder.verified() is not None:
                    return self._builder_failed(status)
            elif self.folder.holder() is not None:
                return self._building()
            return self._ensure(None, wait=False)
        except OSError as error:
            return self._why(_cannot_use(error))

    def _builder_failed(self, status: int | None) -> str:
        """The reason after a builder that exited with ``status`` (None: stopped at the deadline); notes the failure
        when the builder died before it could (a crash, a signal, the deadline)."""
        record = self.folder.failure_record()
        if record is None or record.at < self.started_wall:
            what = f"took longer than {self.timeout_s:.0f} s" if status is None else f"stopped with status {status}"
            self.folder.note_failure(f"the build {what}: {_last_error(self.folder.log)}", self.identity, self.clock())
        return self._noted()

    # -- in the foreground ---------------------------------------------------------------------------------

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.folder.folder.mkdir(parents=True, exist_ok=True)
        self.started_wall = time.time()  # a failure the builder notes is later than this
        with open(self.folder.log, "wb") as log:
            return subprocess.Popen(
                [*self.command, str(self.folder.folder)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # Ctrl+C in the terminal, or the app ending, leaves it to finish
            )

    def build(self, progress: Progress | None) -> str | None:
        """Run the builder in the foreground (or wait for another process's); None when it installed a library."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        while True:
            holder = self.folder.holder()
            if holder is None:
                break
            if progress is not None:
                progress(f"{COMPILING} (another specchat process, {holder}, is at it)", None)  # one step: no counter
            if time.monotonic() > deadline:
                return self._why(f"another process ({holder}) has been building it for {self.timeout_s:.0f} s")
            time.sleep(0.5)
            if self.folder.verified() is None:
                return None
        self.notes.append("built the library")
        self.started = started
        child = self._spawn()
        status = self._follow(child, started, deadline, progress)
        self.built_s = time.monotonic() - started
        if status == BUSY_EXIT:  # another process took the lock first: wait for its library
            return self.build(progress) if self.folder.verified() is not None else None
        if status != 0 or self.folder.verified() is not None:
            return self._builder_failed(status)
        return None

    def _follow(
        self, child: subprocess.Popen[bytes], started: float, deadline: float, progress: Progress | None
    ) -> int | None:
        """Wait for the builder, reporting ninja's steps; its exit status, or None when stopped at the deadline."""
        while True:
            try:
                return child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                os.killpg(child.pid, 9)
                child.wait()
                return None
            if progress is not None:
                step = _last_step(self.folder.log)
                where = f", step {step[0]} of {step[1]}" if step else ""
                progress(f"{COMPILING}: {time.monotonic() - started:.0f} s{where}", step[0] / step[1] if step else None)

    def rebuild(self, progress: Progress | None = None) -> str | None:
        """Forget this key's library and failure note, and build it again (``specchat doctor
        --rebuild-native``); None when the new library is loaded."""
        if self.folder.holder() is not None:
            return self._why(f"{self.folder.holder()} is building it right now; try again when it has finished")
        self.folder.wipe()
        self.notes.append(f"removed {self.folder.folder}")
        self.loaded = False
        return self.ensure(progress, retries=0)


def _cannot_use(error: OSError) -> str:
    where = f" {error.filename}" if error.filename else ""
    return f"the cache folder cannot be used ({error.strerror or error}{where})"


_STEP = re.compile(rb"^\[(\d+)/(\d+)\]", re.MULTILINE)


def _last_step(log: Path) -> tuple[int, int] | None:
    """The last ``[k/n]`` step ninja printed in the build log."""
    try:
        found = _STEP.findall(log.read_bytes()[-20000:])
    except OSError:
        return None
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def _last_error(log: Path) -> str:
    """The last line of the build log that says what went wrong (an error, an exception's text)."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(lines):
        if any(mark in line for mark in ("error", "Error", "what():", "failed")):
            return " ".join(line.split())[:300]
    return " ".join(lines[-1].split())[:300] if lines else "no output"
