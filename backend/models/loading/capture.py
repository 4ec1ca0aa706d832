"""Keep library chatter (transformers, huggingface_hub, bitsandbytes, accelerate) off the terminal.

``capture_library_output(progress=None, log_file=None)`` is a context manager. While it is active:

- records of the libraries' loggers go to the returned :class:`CapturedOutput` (``.lines``), are appended to
  ``log_file`` when given, and are passed to the root logger's non-terminal handlers (an app's log file); they
  are not printed;
- ``warnings.warn`` messages are captured the same way;
- tqdm progress bars of transformers (weight loading; GGUF de-quantisation inside :func:`routed_gguf_progress`,
  which the conversion opens) and of huggingface_hub (downloads, when :func:`progress_tqdm_class` is passed as
  ``tqdm_class``) draw nothing; their state is reported to
  ``progress(message, fraction)`` instead (fraction in 0..1, or None when the total is unknown);
- Python-level writes to ``sys.stdout`` / ``sys.stderr`` are captured as lines, except those made by
  ``progress`` or by callbacks wrapped with :func:`user_callback` (a CLI's progress line, a download
  question asked with ``input()``), which reach the terminal.

Not captured: writes that C extensions make straight to file descriptors 1/2 (redirecting those would also
swallow a Textual UI drawing on the same terminal). The state it changes is process-wide: use it around
loading, from one thread at a time; nested uses restore in LIFO order. ``progress`` may be called from
download threads, so a UI must make it thread-safe (e.g. post a message).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.std import tqdm as _std_tqdm

Progress = Callable[[str, float | None], None]
LIBRARY_LOGGERS = (
    "transformers",
    "huggingface_hub",
    "bitsandbytes",
    "accelerate",
    "safetensors",
    "gguf",
    "torch",
    "httpx",
    "httpcore",
    "filelock",
    "urllib3",
)


@dataclass
class CapturedOutput:
    """What the libraries said while captured, one string per line (log records prefixed by their level)."""

    lines: list[str] = field(default_factory=list)


class _NullFile(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


def progress_tqdm_class(progress: Progress | None) -> type[_std_tqdm]:
    """A tqdm subclass that draws nothing and reports each refresh to ``progress`` (if any)."""

    class ProgressTqdm(_std_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub's group name; plain tqdm rejects it
            kwargs["file"] = _NullFile()
            kwargs["disable"] = False
            self._report = progress  # set before super().__init__, whose first refresh calls display()
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None):  # noqa: ARG002 - tqdm's signature
            if self._report is None:
                return True
            total = self.total or 0
            desc = (self.desc or "").strip().rstrip(":.").strip() or "Working"
            if self.unit == "B":
                from specchat.backend.models.facts.memory import format_bytes

                done, whole = format_bytes(self.n), format_bytes(total)
                text = f"{desc}: {done} of {whole}" if total else f"{desc}: {done}"
            else:
                text = f"{desc}: {self.n:g}/{total:g}" if total else desc
            self._report(text, min(1.0, self.n / total) if total else None)
            return True

    # tqdm's default lock may start a multiprocessing resource tracker, which fails when stderr is not a
    # real file (a Textual app); a thread lock is all one process needs.
    ProgressTqdm.set_lock(threading.RLock())
    return ProgressTqdm


class _LineHandler(logging.Handler):
    def __init__(self, emit_record: Callable[[logging.LogRecord], None]):
        super().__init__(logging.DEBUG)
        self._emit_record = emit_record

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._emit_record(record)
        except Exception:  # a logging failure must never break loading
            self.handleError(record)


def _file_handlers() -> list[logging.Handler]:
    """The root logger's handlers that do not write to a terminal (e.g. the app's log file)."""
    return [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler) or not isinstance(h, logging.StreamHandler)
    ]


_callback = threading.local()  # .active: this thread is running a user callback (its prints must show)


def user_callback(fn: Callable | None) -> Callable | None:
    """Wrap a caller's callback (progress, confirm_download) so that what it prints, or asks with ``input()``,
    reaches the real terminal even while library output is being captured."""
    if fn is None:
        return None

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        previous = getattr(_callback, "active", False)
        _callback.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            _callback.active = previous

    return wrapped


class _LineWriter(io.TextIOBase):
    """A file-like sink that turns written text into whole lines (user callbacks write through to ``original``)."""

    def __init__(self, emit_line: Callable[[str], None], original):
        self._emit_line, self._original, self._buffer = emit_line, original, ""

    def write(self, text: str) -> int:
        if getattr(_callback, "active", False):
            return self._original.write(text)
        self._buffer += text.replace("\r", "\n")
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            if line.strip():
                self._emit_line(line)
        return len(text)

    def flush(self) -> None:
        if getattr(_callback, "active", False):
            self._original.flush()
            return
        if self._buffer.strip():
            self._emit_line(self._buffer)
        self._buffer = ""


class _Block:
    """An open capture block: where its progress bars go, what to undo when it closes, and whether transformers'
    bars are routed to it yet."""

    __slots__ = ("tqdm_class", "restore", "hooked")

    def __init__(self, tqdm_class: type, restore: list[Callable[[], None]]) -> None:
        self.tqdm_class, self.restore, self.hooked = tqdm_class, restore, False


_blocks: list[_Block] = []  # the capture blocks now open, innermost last (routed_gguf_progress reads it too)


@contextlib.contextmanager
def routed_gguf_progress(gguf_utils: Any) -> Iterator[None]:
    """Within the block, the bars of transformers' GGUF reader (its module ``gguf_utils``, which uses tqdm.auto
    directly, not transformers' hookable tqdm) go where the innermost open capture block sends progress.

    The conversion (``convert.py``) calls it where it imports that module: importing it in every capture block
    cost seconds of every start (it runs transformers' lazy-import scan of all its models), though only a first
    start converts."""
    if not _blocks or not hasattr(gguf_utils, "tqdm"):
        yield
        return
    original = gguf_utils.tqdm
    gguf_utils.tqdm = _blocks[-1].tqdm_class
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def transformers_imported() -> None:
    """Route transformers' progress bars to the innermost open capture block (undone when it closes).

    A block does this when it opens if transformers is already imported; code that imports transformers inside a block
    calls it afterwards. Importing transformers only for this cost a second of every start (``benchmarks/RESULTS.md``,
    "Figures moved out of the code"), which the int4 default (``light_tokenizer.py``, ``skeleton.py``) never needs."""
    if not _blocks or _blocks[-1].hooked:
        return
    block = _blocks[-1]
    block.hooked = True
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as tf_logging

        if hasattr(tf_logging, "set_tqdm_hook"):
            tqdm_class = block.tqdm_class
            previous = tf_logging.set_tqdm_hook(lambda factory, args, kwargs: tqdm_class(*args, **kwargs))
            block.restore.append(lambda: tf_logging.set_tqdm_hook(previous))
        elif tf_logging.is_progress_bar_enabled():  # older transformers: silence instead of routing
            tf_logging.disable_progress_bar()
            block.restore.append(tf_logging.enable_progress_bar)


@contextlib.contextmanager
def capture_library_output(
    progress: Progress | None = None, log_file: str | Path | None = None
) -> Iterator[CapturedOutput]:
    """Route library logging, warnings, progress bars and Python-level prints away from the terminal."""
    captured = CapturedOutput()
    lock = threading.Lock()
    log = None
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_file, "a", encoding="utf-8")  # noqa: SIM115 - closed in finally

    forward = _file_handlers()

    def emit_record(record: logging.LogRecord) -> None:
        line = f"{record.levelname} {record.name}: {record.getMessage()}"
        with lock:  # download threads log concurrently
            captured.lines.append(line)
            if log is not None:
                log.write(line + "\n")
                log.flush()
        for target in forward:  # keep the app's log file complete
            if record.levelno >= target.level:
                target.handle(record)

    def emit_line(line: str, name: str = "stdout", level: int = logging.INFO) -> None:
        emit_record(
            logging.makeLogRecord(
                {"name": name, "levelno": level, "levelname": logging.getLevelName(level), "msg": line}
            )
        )

    handler = _LineHandler(emit_record)
    saved_loggers = []
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        saved_loggers.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers, logger.propagate = [handler], False

    progress = user_callback(progress)
    tqdm_class = progress_tqdm_class(progress)
    restore: list[Callable[[], None]] = []
    with contextlib.suppress(ImportError):
        import huggingface_hub.utils as hf_utils

        if not hf_utils.are_progress_bars_disabled():
            hf_utils.disable_progress_bars()  # any bar we do not route ourselves stays silent
            restore.append(hf_utils.enable_progress_bars)
    block = _Block(tqdm_class, restore)
    _blocks.append(block)
    restore.append(lambda: _blocks.remove(block))
    if "transformers" in sys.modules:
        transformers_imported()

    out_writer, err_writer = _LineWriter(emit_line, sys.stdout), _LineWriter(emit_line, sys.stderr)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out_writer), contextlib.redirect_stderr(err_writer):
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: emit_line(
                f"{category.__name__}: {message}", "py.warnings", logging.WARNING
            )
            yield captured
    finally:
        out_writer.flush()
        err_writer.flush()
        for undo in reversed(restore):
            undo()
        for logger, handlers, propagate in saved_loggers:
            logger.handlers, logger.propagate = handlers, propagate
        if log is not None:
            log.close()
