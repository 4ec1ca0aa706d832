"""The native library (``csrc/*.cpp``: the weight kernels and the native model, one library registering the
``specchat`` TorchScript classes and ops): built once per machine with ``torch.utils.cpp_extension`` (its
flags, ABI handling and ninja build), cached, checked before every load, and loaded into this process.

Contract:
- :func:`ensure(progress)` makes the library usable in this process and returns None, or returns the one-line
  reason it is not (the line the UI, ``specchat generate`` and ``specchat serve`` print; it names the build log
  where one exists). In order: ``SPECCHAT_NATIVE=0`` turns it off; a library already loaded is used; a cached
  library is loaded only after its bytes match the sha256 its build recorded (``native_cache.py``; nothing of
  it is loaded before); a mismatch (truncated, corrupted, foreign), or a load that fails, discards it and
  builds it once more; a failure noted for this key (same sources, flags, torch and compiler) is not retried
  (:func:`rebuild` does, as ``specchat doctor --rebuild-native``); no compiler or no ninja is a reason.
- A build runs in the foreground in a child process (``python -m specchat.backend.kernels.native_build build
  FOLDER``) that takes the build lock, compiles into the key's folder with warnings on (``-Wall -Wextra``; the
  sources build without any), loads the result once to check it, and installs it with its sha256. Progress is
  reported as "compiling the CPU kernels for this machine, once" with ninja's step count. A child killed
  mid-build blocks nothing (``native_cache.CacheFolder.take_lock``); a parent killed mid-build leaves the child
  to finish for the next start. Several processes starting at once compile once: the others wait for the lock.
- The cache folder is ``paths.cache_dir()/native/<key>`` (``SPECCHAT_NATIVE_CACHE`` replaces
  ``cache_dir()/native``: the test suite shares one build across its tests), the key a hash of the sources,
  flags, torch's version, the compiler's identity and version, Python's version and the platform.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specchat.backend.kernels import native_cache, switched_off
from specchat.backend.kernels.native_cache import CacheFolder
from specchat.backend.paths import cache_dir

CSRC = Path(__file__).with_name("csrc")
NAME = "specchat_native"
SWITCH = "SPECCHAT_NATIVE"
# -fopenmp: at::parallel_for (the kernels' and the model's threads) is an OpenMP region compiled into the caller,
# serial without it (qweight.cpp refuses to build then). -ffp-contract=off: no fused multiply-add the source did
# not write, so the kernels' AVX-512, AVX2 and scalar paths agree bit for bit.
FLAGS = ("-O3", "-Wall", "-Wextra", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 1200
BUSY_EXIT = 3  # the builder's exit status when another process holds the build lock
COMPILING = "compiling the CPU kernels for this machine, once"
Progress = Callable[[str, "float | None"], None]


def sources() -> list[Path]:
    """The library's sources: every ``csrc/*.cpp`` (the headers beside them are part of the key)."""
    return sorted(CSRC.glob("*.cpp"))


def compiler() -> str | None:
    """The C++ compiler a build uses: ``CXX`` if set, else the first of c++, g++, clang++ on PATH."""
    chosen = os.environ.get("CXX", "").strip()
    if chosen:
        return shutil.which(chosen)
    return next((found for name in ("c++", "g++", "clang++") if (found := shutil.which(name))), None)


_VERSIONS: dict[str, str] = {}


def compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version`` (part of the build key: a new compiler builds anew)."""
    if cxx not in _VERSIONS:
        try:
            done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
            _VERSIONS[cxx] = (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError, IndexError):
            _VERSIONS[cxx] = ""
    return _VERSIONS[cxx]


def _ninja_dirs() -> list[str]:
    """Folders holding a ``ninja`` (the ``ninja`` package's, and this interpreter's scripts folder), put first on
    the builder's PATH: cpp_extension runs ``ninja`` by name and a virtualenv need not be activated."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    return dirs


def ninja() -> str | None:
    path = os.pathsep.join([*_ninja_dirs(), os.environ.get("PATH", "")])
    return shutil.which("ninja", path=path)


def build_key(cxx: str) -> str:
    import torch

    digest = hashlib.sha256()
    for source in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for part in (
        " ".join(FLAGS + LDFLAGS),
        torch.__version__,
        cxx,
        compiler_version(cxx),
        f"{sys.version_info[0]}.{sys.version_info[1]}",
        sys.platform,
        platform.machine(),
    ):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    override = os.environ.get("SPECCHAT_NATIVE_CACHE", "").strip()
    return Path(override) if override else cache_dir() / "native"


def folder_for(cxx: str) -> CacheFolder:
    return CacheFolder(cache_root() / build_key(cxx))


# -- the builder (a child process) --------------------------------------------------------------------------


def compile_into(folder: CacheFolder) -> Path:
    """Build the library with cpp_extension into ``folder``'s build folder, load it once (cpp_extension does,
    with ``is_python_module=False``: a library that does not load is a failed build), return its path."""
    from torch.utils import cpp_extension

    folder.build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=NAME,
        sources=[str(s) for s in sources()],
        extra_cflags=list(FLAGS),
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(CSRC)],
        build_directory=str(folder.build),
        verbose=True,
        is_python_module=False,
    )
    return folder.build / f"{NAME}.so"


def build_in(folder: CacheFolder, compile_step: Callable[[CacheFolder], Path] = compile_into) -> int:
    """The builder's work (see the module docstring); its exit status (0 built, BUSY_EXIT, 1 failed)."""
    holder = folder.take_lock()
    if holder is not None:
        print(f"{holder} is building the library already", flush=True)
        return BUSY_EXIT
    try:
        folder.clear_failure()
        try:
            built = compile_step(folder)
            digest = folder.install(built)
        except BaseException as error:  # noqa: BLE001 - any failure is noted for the parent and later starts
            reason = " ".join(str(error).split())[-600:] or type(error).__name__
            folder.note_failure(f"the build failed: {reason}")
            print(f"build failed: {reason}", flush=True)
            return 1
        print(f"built {folder.library} (sha256 {digest})", flush=True)
        return 0
    finally:
        folder.release_lock()


def main(argv: Sequence[str]) -> int:
    """``python -m specchat.backend.kernels.native_build build FOLDER``: build into FOLDER (a cache folder)."""
    if len(argv) != 2 or argv[0] != "build":
        print("usage: python -m specchat.backend.kernels.native_build build FOLDER", file=sys.stderr)
        return 2
    return build_in(CacheFolder(Path(argv[1])))


# -- the parent: ensure / rebuild ---------------------------------------------------------------------------


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
    ) -> None:
        self.folder, self.command, self.load_into_process, self.env = folder, command, load, env
        self.timeout_s = timeout_s
        self.loaded = False
        self.built_s: float | None = None  # how long this process's build took (None: none ran)
        self.notes: list[str] = []  # what happened (discarded a damaged library, rebuilt, ...), for doctor

    def _why(self, what: str) -> str:
        return f"{what} (log: {self.folder.log})"

    def _failed(self, failure: str) -> str:
        return self._why(f"{failure}; `specchat doctor --rebuild-native` tries again")

    def ensure(self, progress: Progress | None = None, *, retries: int = 1) -> str | None:
        """None once loaded; else the one-line reason (see the module docstring)."""
        if self.loaded:
            return None
        try:
            return self._ensure(progress, retries)
        except OSError as error:  # a cache folder that cannot be written or read: say where
            where = f" {error.filename}" if error.filename else ""
            return self._why(f"the cache folder cannot be used ({error.strerror or error}{where})")

    def _ensure(self, progress: Progress | None, retries: int) -> str | None:
        for attempt in range(retries + 1):
            damaged = self.folder.verified()
            if damaged is not None and damaged != "not built yet":
                self.notes.append(f"discarded the cached library: {damaged}")
                self.folder.discard()
            if not self.folder.library.exists():
                failed = self.folder.failure()
                if failed is not None:
                    return self._failed(failed)
                failed = self.build(progress)
                if failed is not None:
                    return failed
                damaged = self.folder.verified()
                if damaged is not None:
                    self.folder.discard()
                    return self._why(f"the library just built does not check out: {damaged}")
            try:
                self.load_into_process(self.folder.library)
            except Exception as error:  # noqa: BLE001 - a library that does not load is rebuilt once
                reason = " ".join(str(error).split())[:300] or type(error).__name__
                self.notes.append(f"the cached library did not load ({reason})")
                self.folder.discard()
                if attempt == retries:
                    self.folder.note_failure(f"the library built but does not load: {reason}")
                    return self._failed(f"the library built but does not load: {reason}")
                continue
            self.loaded = True
            return None
        return self._why("the library could not be made usable")

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
        self.folder.folder.mkdir(parents=True, exist_ok=True)
        self.notes.append("built the library")
        with open(self.folder.log, "wb") as log:
            child = subprocess.Popen(
                [*self.command, str(self.folder.folder)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # Ctrl+C in the terminal leaves it to finish for the next start
            )
        status = self._follow(child, started, deadline, progress)
        self.built_s = time.monotonic() - started
        if status == BUSY_EXIT:  # another process took the lock first: wait for its library
            return self.build(progress) if self.folder.verified() is not None else None
        if status != 0 or self.folder.verified() is not None:
            if status is None:
                return self._failed(f"the build took longer than {self.timeout_s:.0f} s and was stopped")
            if self.folder.failure() is None:  # the builder died before it could say why (a crash, a signal)
                self.folder.note_failure(f"the build stopped with status {status}: {_last_error(self.folder.log)}")
            return self._failed(self.folder.failure() or f"the build exited with status {status}")
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
                self.folder.note_failure(f"the build took longer than {self.timeout_s:.0f} s")
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


def builder_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([*_ninja_dirs(), env.get("PATH", "")])
    cxx = compiler()
    if cxx is not None:
        env["CXX"] = cxx
    return env


def unavailable() -> str | None:
    """Why no build can run here (switched off, no compiler, no ninja), before any build key is computed."""
    if switched_off(SWITCH):
        return f"turned off ({SWITCH}=0)"
    if not native_cache.HAS_FCNTL or sys.platform == "win32":
        return "the CPU kernels are built on Linux and macOS only"
    if compiler() is None:
        return "no C++ compiler found (install g++ or clang++, or set CXX)"
    if ninja() is None:
        return "ninja is not installed (pip install ninja)"
    return None


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
