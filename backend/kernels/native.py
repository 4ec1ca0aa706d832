"""The native library in this process: the one :class:`~specchat.backend.kernels.native_library.Library` of this
machine's build key, made usable once (:func:`ensure`), and why it is not when it is not (:func:`reason`).

A start that finds no library builds it in the background (``ensure(wait=False)``, what loading a model asks
unless ``SPECCHAT_NATIVE_BUILD=wait``): the model runs on the path that needs no compiler meanwhile, and
:func:`poll` (the engine asks between replies) loads the library once it is installed, so the engine can
swap the native model in (``backend/engine/upgrade.py``).

``native_build.py`` says how the library is built, ``native_library.py`` how it is cached, checked and loaded;
``native_model.py`` is the model it runs. ``SPECCHAT_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from specchat.backend.kernels import native_build, native_cache
from specchat.backend.kernels.native_library import BUILDING, Library

_lock = threading.Lock()
_library: Library | None = None
_reason: str | None = None
_checked = False
_in_process: str | None = None  # the sha256 of the library loaded into this process (one at most)
BUILD_MODE = "SPECCHAT_NATIVE_BUILD"  # "wait": a start that must build waits for it (no background build)


def background_builds() -> bool:
    """Whether loading a model builds a missing library in the background (the default) or waits for it."""
    return os.environ.get(BUILD_MODE, "").strip().lower() != "wait"


def load(path: Path) -> None:
    """Load a checked library into this process and confirm it registers the native model's and the weight
    kernels' classes. Once one has, the same bytes again (another copy: ``CacheFolder.stage``) are not loaded a
    second time (their classes would register twice, which aborts the process), and other bytes are refused."""
    import torch

    global _in_process
    digest = native_cache.sha256_of(path)[0]
    if _in_process is not None:
        if digest != _in_process:
            raise RuntimeError("another build of the library is loaded in this process already; restart specchat")
        return
    torch.ops.load_library(str(path))
    for name in ("NativeModel", "QWeight"):
        try:
            getattr(torch.classes.specchat, name)
        except (RuntimeError, AttributeError) as error:
            raise RuntimeError(f"{path.name} does not register torch.classes.specchat.{name}") from error
    _in_process = digest


def library() -> Library | None:
    """This machine's library (its cache folder and builder), or None when no build can run here."""
    global _library
    if _library is None and native_build.unavailable() is None:
        cxx = native_build.compiler()
        assert cxx is not None  # noqa: S101 - unavailable() checked it
        _library = Library(
            native_build.folder_for(cxx),
            [sys.executable, "-m", "specchat.backend.kernels.native_build", "build"],
            load=load,
            env=native_build.builder_env(),
        )
    return _library


def ensure(progress: native_build.Progress | None = None, *, wait: bool = True) -> str | None:
    """None once the library is usable in this process; else the one-line reason. ``SPECCHAT_NATIVE=0``, a
    missing compiler or ninja are looked at on every call; a build's outcome is remembered (later calls return
    it without building again). ``wait=False``: a build that is needed runs in the background (the reason then
    starts with ``native_library.BUILDING``); ``wait=True`` while one runs waits for it."""
    global _reason, _checked
    with _lock:
        why = native_build.unavailable()
        if why is not None:
            return why
        found = library()
        if found is None:
            return native_build.unavailable()
        if not _checked:
            _reason = found.ensure(progress, wait=wait)
            _checked = True
        while wait and building():
            if progress is not None:
                progress(f"{native_build.COMPILING} ({(_reason or '').split('(', 1)[-1].split(')')[0]})", None)
            time.sleep(0.5)
            _reason = found.poll()
        return _reason


def building() -> bool:
    """Whether a background build is under way for this process (:func:`poll` loads its library when done)."""
    return _reason is not None and _reason.startswith(BUILDING)


def poll() -> bool:
    """Between replies: load the library a background build has installed. True when it is usable now."""
    global _reason
    with _lock:
        if _library is not None and building():
            _reason = _library.poll()
        return _checked and _reason is None


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
