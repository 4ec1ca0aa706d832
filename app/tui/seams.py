"""What the UI is given by the layer that builds it (app/cli/chat.py, with app/cli/wiring.py): typed callables
that reach the backend beyond its API, so app/tui and app/chat import only ``specchat.backend.api`` (plus
``errors``, ``paths``, ``files``) and never loading, memory, hub or the engine itself.

- :class:`EngineFactory`: ``factory(pair, progress, confirm_download) -> EngineAPI``. Always called with all three,
  in the app's loader thread (a daemon thread: it may import torch and download weights). ``progress(message,
  fraction)`` reports a stage (``fraction`` 0..1, or None when unknown); ``confirm_download(total_bytes)`` asks
  the user before a download and returns whether to go on (a factory that needs no download never calls it).
  A user-facing failure raises ``SpecchatError``; anything else is reported as a bug.
- :class:`PairInfo`: ``pair_info(pair) -> dict`` of the picker's estimates (keys in screens/picker.py); run in a
  thread worker, never touching the network.

And what the chat screen is given by the app that holds it:

- :class:`ChatHost`: the app as the chat screen and its controllers read it (``SpecchatApp`` is one): the loaded
  pair's engine, the pair being loaded, the settings a reply uses, the history store, the log file and the help.
  Read-only: only the app changes these (loading pairs, saving settings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from specchat.app.chat.history.store import ChatStore
    from specchat.app.chat.settings import Settings
    from specchat.backend.api import EngineAPI
    from specchat.backend.models.catalog.config import PairConfig

Progress = Callable[[str, float | None], None]
ConfirmDownload = Callable[[int], bool]


class EngineFactory(Protocol):
    def __call__(self, pair: PairConfig, progress: Progress, confirm_download: ConfirmDownload) -> EngineAPI: ...


class PairInfo(Protocol):
    def __call__(self, pair: PairConfig) -> dict[str, Any]: ...


class ChatHost(Protocol):
    @property
    def engine(self) -> EngineAPI | None:
        """The loaded pair's engine; None while no pair is loaded (or one is loading)."""

    @property
    def current_pair_name(self) -> str | None:
        """The loaded pair's name; None when none is loaded."""

    @property
    def current_pair(self) -> PairConfig | None:
        """The loaded pair's configuration; None when none is loaded."""

    @property
    def loading_pair(self) -> str | None:
        """The pair being loaded now, if any."""

    @property
    def settings(self) -> Settings:
        """The settings the next reply uses."""

    @property
    def store(self) -> ChatStore | None:
        """The history store; None when history is disabled for the session."""

    @property
    def log_path(self) -> Path | None:
        """The log file that holds tracebacks (named in error notifications)."""

    def action_help(self) -> None:
        """Show the help screen."""
