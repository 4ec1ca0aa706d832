"""The app's default connections to the real backend, imported lazily, and the routing of library output.

Contract:
- :func:`default_engine_factory` returns an ``EngineFactory`` (app/tui/seams.py): ``factory(pair, progress,
  confirm_download) -> EngineAPI`` (a remote pair's is a ``specchat.backend.remote.client.RemoteEngine``). A local
  engine's suffix drafter is given the earlier replies ``replies()`` returns (the local history, oldest first),
  or none and no memory of this session's replies when ``replies`` is None (``--no-history``) or returns None
  (the "earlier replies" setting is off). It
  imports ``specchat.backend.engine.engine`` inside the call, i.e. in the
  app's loader thread, so the UI never pays for importing torch. ``confirm_download(total_bytes) -> bool``
  comes from the app (a dialog, or the picker's earlier yes).
- :func:`default_pair_info` returns a ``PairInfo``: ``pair_info(pair) -> dict`` for the picker (keys documented
  in screens/picker.py), from ``specchat.backend.models.facts.memory`` and the local HF cache (run in a thread worker:
  it imports torch; it never touches the network), or for a remote pair the server's reachability
  (``specchat.backend.remote.client.check_server``: one ``GET /models`` with a short timeout).
- :func:`route_library_output` (a context manager, for the whole app run) sends Python logging and warnings
  to ``<log dir>/specchat.log`` instead of the terminal; stray prints are caught by Textual and forwarded to
  the same file by the app (``App.begin_capture_print``).
  ``specchat.backend.models.loading.capture.capture_library_output``
  additionally wraps each model load (tqdm bars become the app's progress display).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specchat.app.tui.seams import ConfirmDownload, EngineFactory, PairInfo, Progress

if TYPE_CHECKING:
    from specchat.backend.api import EngineAPI
    from specchat.backend.models.catalog.config import PairConfig

LOG_FILE = "specchat.log"
# Characters of earlier replies read for the suffix drafter: about what its memory holds (200,000 tokens).
REPLY_MEMORY_CHARS = 800_000


def default_engine_factory(device: str | None, replies: Callable[[], list[str] | None] | None = None) -> EngineFactory:
    def factory(pair: PairConfig, progress: Progress, confirm_download: ConfirmDownload) -> EngineAPI:
        if pair.remote is not None:  # nothing to load: the server runs the model
            from specchat.backend.redact import mask_url
            from specchat.backend.remote.client import RemoteEngine

            progress(f"connecting to {mask_url(pair.remote.server)}", None)
            return RemoteEngine(pair)
        from specchat.backend.models.loading.capture import capture_library_output

        # The import itself (torch, transformers) may warn: capture it too; load_pair captures the loading.
        with capture_library_output():
            from specchat.backend.engine.engine import load_engine

            engine = load_engine(pair, device=device, progress=progress, confirm_download=confirm_download)
        seed_reply_memory(engine, replies, progress)
        return engine

    return factory


def start_line(pair_name: str, engine: Any) -> str:
    """The line ``generate`` and ``serve`` print after loading, and the UI shows when the pair is ready: how the
    model runs (``Engine.start_line``: the CPU native path and its kernels, or why it does not run)."""
    return f"specchat: {pair_name} runs on {getattr(engine, 'start_line', None) or 'its server'}"


def seed_reply_memory(engine: Any, replies: Callable[[], list[str] | None] | None, progress: Progress) -> None:
    """Give the engine's suffix drafter the earlier replies (``replies()``), or switch its memory off."""
    texts = replies() if replies is not None else None
    if texts is None:
        engine.use_reply_memory(False)
        return
    progress("reading earlier replies for the suffix drafter", None)
    engine.use_reply_memory(True, texts)


def default_pair_info(device: str | None) -> PairInfo:
    def pair_info(pair: PairConfig) -> dict[str, Any]:
        if pair.remote is not None:  # no memory here; is the server there, and does it serve the model?
            from specchat.backend.remote.client import check_server

            return {"remote": True, **check_server(pair.remote, pair.name)}
        from specchat.backend.bench.measured import expected_slower, expected_speed
        from specchat.backend.models.facts.memory import estimate_pair, free_memory
        from specchat.backend.models.hub import hub_gguf
        from specchat.backend.models.hub.repos import is_cached
        from specchat.backend.models.loading.pair import resolve_device

        dev = resolve_device(device)
        estimate = estimate_pair(pair, dev)
        free = free_memory(dev)
        draft = pair.draft if pair.drafter == "draft-model" else None
        specs = [s for s in (pair.local_target, draft) if s is not None]
        # models.yaml's size for what is not in the local HF cache: no network access from the picker
        download = sum(s.download_bytes for s in specs if s.kind == "hub" and not is_cached(s))
        download += sum(s.download_bytes for s in specs if s.kind == "hub-gguf" and hub_gguf.cached_path(s) is None)
        speed = expected_speed(pair.name, pair.local_target.source)
        slower = expected_slower(pair, str(dev))
        if not estimate.known:
            known = {"speed": speed, "slower": slower, "device": str(dev)}
            return {"error": "memory known once its files are downloaded", **known}
        return {
            "speed": speed,
            "slower": slower,
            "memory_bytes": estimate.total,
            "free_bytes": free,
            "fits": estimate.total <= free,
            "download_bytes": download,
            "gated": any(s.gated for s in specs),
            "device": str(dev),
        }

    return pair_info


@contextlib.contextmanager
def route_library_output(path: Path) -> Iterator[logging.Handler | None]:
    """Send logging and warnings to ``path`` while the app runs; restore the handlers afterwards."""
    root = logging.getLogger()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler | None = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        handler = None  # an unwritable log dir must not stop the app: log records are dropped instead
    saved_handlers, saved_level = root.handlers[:], root.level
    terminal = [
        h for h in root.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    for h in terminal:
        root.removeHandler(h)
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    else:
        root.addHandler(logging.NullHandler())
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            yield handler
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        if handler is not None:
            handler.close()
