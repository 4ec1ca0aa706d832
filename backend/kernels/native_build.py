"""Building the native decoder layers' library (``native_pass.cpp``, ``native_attention.h``) with the machine's
C++ compiler, cached per source, flags, torch version and platform; one build at a time across processes.
``backend/kernels/native.py`` loads, checks and attaches what this builds (its docstring says when).

    python -m specchat.backend.kernels.native_build build [OUT]   # build now, in the foreground
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from specchat.backend.paths import cache_dir

SOURCE = Path(__file__).with_name("native_pass.cpp")
HEADERS = (Path(__file__).with_name("native_attention.h"),)  # what SOURCE includes from beside it
BUILD_TIMEOUT_S = 600


FLAGS = ("-O3", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC", "-w")  # no fused multiply-adds: see the .cpp


def _key() -> str:
    parts = [
        SOURCE.read_bytes(),
        *(h.read_bytes() for h in HEADERS),
        " ".join(FLAGS).encode(),
        torch.__version__.encode(),
        str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
        sys.platform.encode(),
        platform.machine().encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def library_path() -> Path:
    """Where this source, built for this torch and platform, is cached."""
    return cache_dir() / "native" / f"specchat_native-{_key()}.so"


def compiler() -> str | None:
    """The C++ compiler a build would use: ``CXX`` if set, else the first of c++, g++, clang++ on PATH."""
    chosen = os.environ.get("CXX", "").strip()
    if chosen:
        return shutil.which(chosen) or chosen
    return next((found for name in ("c++", "g++", "clang++") if (found := shutil.which(name))), None)


def build_command(cxx: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    return [
        cxx,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        str(SOURCE),
        "-o",
        str(out),
        *(f"-L{p}" for p in libs),
        "-lc10",
        "-ltorch_cpu",
        *(f"-Wl,-rpath,{p}" for p in libs),
    ]


NO_COMPILER = "no C++ compiler found (set CXX, or install g++ or clang++)"
BUSY = "another specchat process is building it"
BUSY_EXIT = 3  # the build command's exit status when another process holds the build lock


def _failure_note(out: Path) -> Path:
    return out.with_suffix(".failed")


def _lock(out: Path) -> Path:
    return out.with_name(out.name + ".building")


def _building(out: Path) -> bool:
    """Whether another process holds the build lock of ``out`` (taken less than BUILD_TIMEOUT_S ago)."""
    try:
        return time.time() - _lock(out).stat().st_mtime < BUILD_TIMEOUT_S
    except OSError:
        return False


def _take_lock(out: Path) -> bool:
    """Take the build lock of ``out`` (one build at a time, across processes); False while another holds it.
    A lock older than BUILD_TIMEOUT_S belonged to a build that died: it is taken over."""
    lock = _lock(out)
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            if _building(out):
                return False
            lock.unlink(missing_ok=True)
    return False


def build(out: Path | None = None) -> str | None:
    """Compile the library into ``out`` (default :func:`library_path`), atomically; None when built, else why
    not (:data:`BUSY` while another process builds it). A failed compile is noted beside ``out`` with the
    compiler's message, so later starts do not retry it with the same compiler."""
    out = out or library_path()
    cxx = compiler()
    if cxx is None:
        return NO_COMPILER
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not _take_lock(out):
            return BUSY
    except OSError as exc:
        return f"cannot write the cache folder {out.parent}: {exc}"
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        try:
            done = subprocess.run(build_command(cxx, partial), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason = f"{cxx} did not run: {exc}"
        else:
            if done.returncode == 0 and partial.exists():
                os.replace(partial, out)
                _failure_note(out).unlink(missing_ok=True)
                return None
            reason = f"{cxx} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}"
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            _failure_note(out).write_text(f"{cxx}\n{reason}\n")
        return reason
    finally:
        _lock(out).unlink(missing_ok=True)


def _earlier_failure(out: Path) -> str | None:
    """The noted reason a build with the current compiler failed before, if it did."""
    try:
        cxx, _, reason = _failure_note(out).read_text().partition("\n")
    except OSError:
        return None
    return reason.strip() if cxx == (compiler() or "") else None


def _wait_for(out: Path, wait_s: float) -> str | None:
    """Wait while another process builds ``out``; None once it exists."""
    deadline = time.monotonic() + wait_s
    while not out.exists() and _building(out) and time.monotonic() < deadline:
        time.sleep(0.5)
    return None if out.exists() else "another specchat process's build did not finish"


def build_in_background(out: Path, wait_s: float = BUILD_TIMEOUT_S) -> str | None:
    """Run :func:`build` in a ``nice``d child process that outlives this one, or wait for another process's
    build of the same library (several specchat processes started at once compile it once). None when built."""
    if compiler() is None:
        return NO_COMPILER
    earlier = _earlier_failure(out)
    if earlier is not None:
        return f"an earlier build failed ({earlier}); delete {_failure_note(out)} to try again"
    if _building(out):
        return _wait_for(out, wait_s)
    nice = (lambda: os.nice(19)) if hasattr(os, "nice") else None
    child = subprocess.Popen(
        [sys.executable, "-m", "specchat.backend.kernels.native_build", "build", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=nice,
    )
    _, err = child.communicate()
    if child.returncode == 0 and out.exists():
        return None
    if child.returncode == BUSY_EXIT:
        return _wait_for(out, wait_s)
    return err.strip()[-1500:] or f"the build exited with {child.returncode}"


def main(argv: list[str]) -> int:
    """``python -m specchat.backend.kernels.native_build build [OUT]``: build the library now (default: its
    cache path); prints where, or why not."""
    if not argv or argv[0] != "build" or len(argv) > 2:
        print("usage: python -m specchat.backend.kernels.native_build build [OUT]", file=sys.stderr)
        return 2
    out = Path(argv[1]) if len(argv) == 2 else library_path()
    failed = build(out)
    if failed is not None:
        print(f"specchat: the native decoder layers were not built: {failed}", file=sys.stderr)
        return BUSY_EXIT if failed == BUSY else 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
