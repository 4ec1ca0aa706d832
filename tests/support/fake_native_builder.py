"""A stand-in for `python -m specchat.backend.kernels.native_build build FOLDER` in the build-cache tests: the real
builder's lock, install and failure handling (native_build.build_in) around a "compile" that copies a small
prebuilt library (FAKE_LIBRARY) in a fraction of a second. FAKE_BUILD picks how the compile goes: ok, fail (a
compiler error), crash (the builder aborts), sleep (FAKE_SLEEP seconds first)."""

import os
import shutil
import sys
import time
from pathlib import Path

from specchat.backend.kernels.native_build import build_in
from specchat.backend.kernels.native_cache import CacheFolder


def compile_step(folder: CacheFolder) -> Path:
    mode = os.environ.get("FAKE_BUILD", "ok")
    if mode == "sleep":
        time.sleep(float(os.environ.get("FAKE_SLEEP", "30")))
    if mode == "fail":
        raise RuntimeError("c++: error: a fake compiler failure")
    if mode == "crash":
        os.abort()
    folder.build.mkdir(parents=True, exist_ok=True)
    (folder.build / "lock").write_text("")  # as cpp_extension's FileBaton leaves it while it builds
    out = folder.build / "specchat_native.so"
    shutil.copyfile(os.environ["FAKE_LIBRARY"], out)
    (folder.build / "lock").unlink()
    return out


if __name__ == "__main__":
    sys.exit(build_in(CacheFolder(Path(sys.argv[1])), compile_step))
