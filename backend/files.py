"""Writing a file atomically: :func:`write_atomic`, the one way specchat replaces a file's content (settings,
chat exports, /edit, the converted-model hash cache).

Contract: a reader (another specchat, an editor, a crash) sees the old content or the new one, never a part of
it, and never an empty file. A failure raises the ``OSError`` and leaves the destination as it was and no
temporary file behind; each caller turns the ``OSError`` into its own user-facing error. This module is a leaf:
it imports only the standard library.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_NAME_CHARS = 200  # of the destination's name in the temporary file's (file names are limited to 255 bytes)


def _create_temporary(path: Path, mode: int) -> tuple[int, Path]:
    """A new, empty file beside ``path`` (O_EXCL: never an existing one), opened for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name[:_NAME_CHARS]}.{os.urandom(4).hex()}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not find a free temporary file name beside {path}")


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable where the platform allows it (not on Windows, nor some file systems)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None) -> None:
    """Replace the content of ``path`` with ``data`` (``str`` is written as UTF-8, line ends untouched).

    ``data`` goes to a temporary file in the same folder, which is flushed and fsynced before ``os.replace``
    renames it over ``path``; then the folder is fsynced where possible, so the rename survives a power cut.
    Permission bits: ``mode`` when given, else those of the file being replaced, else what a new file gets
    (0o666 less the umask). A symlink at ``path`` is replaced by the file, not followed. On any failure (or
    interruption) the temporary file is removed and the error is raised.
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if mode is None:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            pass  # a new file (or one we cannot stat: os.replace reports real problems)
    fd, tmp = _create_temporary(path, 0o666 if mode is None else mode & 0o777)  # the kernel applies the umask
    try:
        try:
            if mode is not None:  # the exact bits, whatever the umask, before any data is written
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, mode)
                else:
                    os.chmod(tmp, mode)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_folder(path.parent)
