"""Where specchat keeps its files: one function per kind of folder, each overridable by an environment variable.

- ``cache_dir`` (``SPECCHAT_CACHE_DIR``; default ``user_cache_dir``, ~/.cache/specchat on Linux): converted
  GGUF models, file hashes;
- ``config_dir`` (``SPECCHAT_CONFIG_DIR``; ``user_config_dir``, ~/.config/specchat): the user's models.yaml and
  settings;
- ``data_dir`` (``SPECCHAT_DATA_DIR``; ``user_data_dir``, ~/.local/share/specchat): conversation history;
- ``log_dir`` (``SPECCHAT_LOG_DIR``; ``data_dir()/logs`` when SPECCHAT_DATA_DIR is set, else ``user_log_dir``):
  log files.

Defaults come from platformdirs with the app name "specchat". The functions only compute paths; they never
create folders (callers ``mkdir(parents=True, exist_ok=True)`` when they write). Tests point all of them at a
temporary folder through the environment variables, so no test touches the real user folders. :func:`expand`
expands ``~`` in a path a user typed without ever raising.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "specchat"


def expand(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` / ``~user`` expanded; left as written when that home cannot be found
    (``Path.expanduser`` raises ``RuntimeError`` there), so the caller's "not found" message names it."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def _override(variable: str) -> Path | None:
    value = os.environ.get(variable, "").strip()
    return expand(value) if value else None


def cache_dir() -> Path:
    """Folder for re-creatable data (converted models, file hashes)."""
    return _override("SPECCHAT_CACHE_DIR") or Path(platformdirs.user_cache_dir(APP_NAME))


def config_dir() -> Path:
    """Folder of the user's configuration (``models.yaml`` adding or overriding pairs)."""
    return _override("SPECCHAT_CONFIG_DIR") or Path(platformdirs.user_config_dir(APP_NAME))


def data_dir() -> Path:
    """Folder of data the user would miss (conversation history)."""
    return _override("SPECCHAT_DATA_DIR") or Path(platformdirs.user_data_dir(APP_NAME))


def documents_dir() -> Path:
    """Where a chat export goes unless the user names another place: ``SPECCHAT_EXPORT_DIR``, else the desktop's
    documents folder (``XDG_DOCUMENTS_DIR`` on Linux, ~/Documents elsewhere) when it exists, else the home folder.
    Never the current directory (an export there went unnoticed, issue 36)."""
    explicit = _override("SPECCHAT_EXPORT_DIR")
    if explicit is not None:
        return explicit
    documents = Path(platformdirs.user_documents_dir())
    return documents if documents.is_dir() else Path.home()


def log_dir() -> Path:
    """Folder of log files (library output captured during loading, UI tracebacks)."""
    explicit = _override("SPECCHAT_LOG_DIR")
    if explicit is not None:
        return explicit
    # A test or a portable setup that moved the data folder expects the logs to follow it.
    if _override("SPECCHAT_DATA_DIR") is not None:
        return data_dir() / "logs"
    return Path(platformdirs.user_log_dir(APP_NAME))
