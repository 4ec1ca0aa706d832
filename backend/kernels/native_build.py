"""The native library (``csrc/*.cpp``: the weight kernels and the native model, one library registering the
``specchat`` TorchScript classes and ops): built once per machine with ``torch.utils.cpp_extension`` (its
flags, ABI handling and ninja build), cached, checked before every load, and loaded into this process.

Contract:
- What a process does with the library (loading it, building it in the foreground or the background, retrying
  a failed build on a back-off) is ``native_library.Library``'s; this module says how a build is made, where,
  and whether one can run here (:func:`unavailable`: ``SPECCHAT_NATIVE=0``, no compiler, no ninja).
- A build runs in a child process (``python -m specchat.backend.kernels.native_build build
  FOLDER``) that takes the build lock, compiles into the key's folder with warnings on (``-Wall -Wextra``; the
  sources build without any), loads the result once to check it, and installs it with its sha256 (a failure
  is noted with :func:`identity`: the specchat version and compiler). Progress is reported as "compiling the
  CPU kernels for this machine, once" with ninja's step count. A child killed
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
import shutil
import subprocess
import sys
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
        try:
            built = compile_step(folder)
            digest = folder.install(built)
        except BaseException as error:  # noqa: BLE001 - any failure is noted for the parent and later starts
            reason = " ".join(str(error).split())[-600:] or type(error).__name__
            folder.note_failure(f"the build failed: {reason}", identity())
            print(f"build failed: {reason}", flush=True)
            return 1
        folder.clear_failure()
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


def identity() -> str:
    """The specchat version and compiler a build ran with (a failed build is retried at once when it changes)."""
    from specchat import __version__

    cxx = compiler()
    return f"specchat {__version__}, {cxx or 'no compiler'} {compiler_version(cxx) if cxx else ''}".strip()


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
