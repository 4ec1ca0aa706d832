"""Small stand-in libraries for the native library's cache tests (tests/backend/kernels/test_native_build.py,
test_native_retry.py): C libraries whose constructor appends their name to a file (so a test sees whether any of
their code ran), and a :class:`Library` whose builder is fake_native_builder.py (the real lock, install and
failure handling around a "compile" that copies one of them)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specchat.backend.kernels.native_cache import CacheFolder
from specchat.backend.kernels.native_library import Library

BUILDER = Path(__file__).resolve().with_name("fake_native_builder.py")
_C = """
#include <stdio.h>
__attribute__((constructor)) static void mark(void) {
  FILE* f = fopen("%s", "a");
  if (f) { fputs("%s\\n", f); fclose(f); }
}
int specchat_fake_%s(void) { return 1; }
"""


def compile_fake(folder: Path, name: str, marks: Path) -> Path:
    """``folder/name.so``: a library exporting ``specchat_fake_<name>`` whose constructor writes ``name`` to
    ``marks``."""
    source, out = folder / f"{name}.c", folder / f"{name}.so"
    source.write_text(_C % (marks, name, name))
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to make the test libraries")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out


def fake_library(root: Path, good: Path, mode: str = "ok", **env: str) -> Library:
    """A Library in ``root/key`` built by the fake builder (``mode``: ok, fail, crash, sleep) from ``good``,
    loaded with ctypes."""
    environment = {**os.environ, "FAKE_LIBRARY": str(good), "FAKE_BUILD": mode, **env}
    return Library(
        CacheFolder(root / "key"),
        [sys.executable, str(BUILDER)],
        load=lambda path: ctypes.CDLL(str(path)),
        env=environment,
        timeout_s=60,
    )
