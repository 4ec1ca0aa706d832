"""Writing a file atomically: :func:`write_atomic`, the one way specchat replaces a file's content (settings,
chat exports, /edit, the converted-model hash cache).

Contract: a reader (another specchat, an editor, a crash) sees the old content or the new one, never a part of
it, and never an empty file. A failure raises the ``OSError`` and leaves the destination as it was and no
temporary file behind; each caller turns the ``OSError`` into its own user-facing error. A process killed
mid-write (``kill -9``) leaves its temporary file, named with its pid: :func:`remove_stale_temporaries` removes
those of dead processes. :func:`read_only_reason` says whether the user made a file or its folder read-only,
from the mode bits (root can write anything, so a failed write cannot tell). This module is a leaf: it imports
only the standard library.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

_NAME_CHARS = 200  # of the destination's name in the temporary file's (file names are limited to 255 bytes)
_STALE_S = 3600  # a temporary file this old is stale whatever its pid says (pid reuse, another machine)


def _create_temporary(path: Path, mode: int) -> tuple[int, Path]:
    """A new, empty file beside ``path`` (O_EXCL: never an existing one), opened for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name[:_NAME_CHARS]}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not find a free temporary file name beside {path}")


def fsync_folder(folder: Path) -> None:
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
                view = view[os.write(fd, view) :]
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
    fsync_folder(path.parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or a pid this platform cannot check): leave its file alone
    return True


def remove_stale_temporaries(path: str | os.PathLike[str]) -> int:
    """Remove the temporary files :func:`write_atomic` left beside ``path`` in processes that died mid-write
    (their pid is gone, or the file is over an hour old); returns how many. Never raises."""
    path = Path(path)
    prefix, removed = f".{path.name[:_NAME_CHARS]}.", 0
    try:
        entries = list(os.scandir(path.parent))
    except (OSError, ValueError):
        return 0
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_text, _, _ = name[len(prefix) : -len(".tmp")].partition("-")
        try:
            old = time.time() - entry.stat(follow_symlinks=False).st_mtime > _STALE_S
        except OSError:
            continue
        if old or (pid_text.isascii() and pid_text.isdigit() and not _alive(int(pid_text))):
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError:
                pass
    return removed


def _mode_allows_writing(st: os.stat_result, path: Path) -> bool:
    if getattr(os, "geteuid", lambda: -1)() == 0:
        return bool(st.st_mode & 0o222)  # root writes anything: respect a file nobody may write
    return os.access(path, os.W_OK)


def read_only_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` must not be written, or None: the file exists without write permission, or the folder that
    would hold it (its nearest existing ancestor when it does not exist yet) has none, or sits on a file system
    mounted read-only. Decided from the mode bits and the mount flags, never by trying; for root, only a file or
    folder that no one may write counts."""
    path = Path(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        pass  # absent (or unreadable): the folder decides
    else:
        if stat.S_ISREG(st.st_mode) and not _mode_allows_writing(st, path):
            return f"{path} is read-only (mode {stat.S_IMODE(st.st_mode):04o})"
    folder = path.parent
    while True:
        try:
            st = os.stat(folder)
            break
        except (OSError, ValueError):
            if folder.parent == folder:
                return None
            folder = folder.parent
    if stat.S_ISDIR(st.st_mode) and not _mode_allows_writing(st, folder):
        return f"its folder {folder} is read-only (mode {stat.S_IMODE(st.st_mode):04o})"
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"the file system holding {folder} is mounted read-only"
    except (OSError, AttributeError):  # no statvfs (Windows)
        pass
    return None
