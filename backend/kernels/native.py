"""The native library in this process: the one :class:`~specchat.backend.kernels.native_build.Library` of this
machine's build key, made usable once (:func:`ensure`), and why it is not when it is not (:func:`reason`).

``native_build.py`` says how the library is built, cached and checked; ``native_model.py`` is the model it
runs. ``SPECCHAT_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from specchat.backend.kernels import native_build

_lock = threading.Lock()
_library: native_build.Library | None = None
_reason: str | None = None
_checked = False


def load(path: Path) -> None:
    """Load a checked library into this process and confirm it registers the native model's and the weight
    kernels' classes."""
    import torch

    torch.ops.load_library(str(path))
    for name in ("NativeModel", "QWeight"):
        try:
            getattr(torch.classes.specchat, name)
        except (RuntimeError, AttributeError) as error:
            raise RuntimeError(f"{path.name} does not register torch.classes.specchat.{name}") from error


def library() -> native_build.Library | None:
    """This machine's library (its cache folder and builder), or None when no build can run here."""
    global _library
    if _library is None and native_build.unavailable() is None:
        cxx = native_build.compiler()
        assert cxx is not None  # noqa: S101 - unavailable() checked it
        _library = native_build.Library(
            native_build.folder_for(cxx),
            [sys.executable, "-m", "specchat.backend.kernels.native_build", "build"],
            load=load,
            env=native_build.builder_env(),
        )
    return _library


def ensure(progress: native_build.Progress | None = None) -> str | None:
    """None once the library is usable in this process; else the one-line reason. ``SPECCHAT_NATIVE=0``, a
    missing compiler or ninja are looked at on every call; a build's outcome is remembered (later calls return
    it without building again)."""
    global _reason, _checked
    with _lock:
        why = native_build.unavailable()
        if why is not None:
            return why
        if not _checked:
            found = library()
            _reason = found.ensure(progress) if found is not None else native_build.unavailable()
            _checked = True
        return _reason


def reason() -> str | None:
    """Why the library is not usable, once :func:`ensure` ran (None: usable, or not asked yet)."""
    return _reason


def rebuild(progress: native_build.Progress | None = None) -> tuple[str | None, list[str]]:
    """``specchat doctor --rebuild-native``: build this key's library again (the failure note and any cached file
    forgotten) and load it; (None or why not, what was done)."""
    global _reason, _checked
    with _lock:
        why = native_build.unavailable()
        found = library() if why is None else None
        if found is None:
            return why, []
        why = found.rebuild(progress)
        _reason, _checked = why, True
        return why, list(found.notes)


def isa() -> str:
    """The path the loaded kernels take on this CPU ("avx512-vnni", "avx512", "avx2", "scalar"; qgemm.h)."""
    import torch

    return str(torch.ops.specchat.kernel_isa())
