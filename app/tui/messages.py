"""The chat app's Textual messages between its parts: small dataclasses, posted by worker threads or widgets (a
widget's own request to the screen, like :class:`~specchat.app.tui.widgets.message_view.BranchFrom`, lives beside it).

Workers never touch widgets: they post these messages (``post_message`` is thread safe) and the UI thread
reacts. Streaming data itself travels in a :class:`~specchat.app.tui.bridge.ReplyBuffer`; a
:class:`ReplyProgress` is only a nudge, posted at most ~10 times a second, telling the UI to drain it, so
the message queue can never be flooded however fast the engine decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:
    from specchat.backend.api import EngineAPI


@dataclass
class ReplyProgress(Message):
    """Reply ``reply_id`` has new text or statistics (or has ended) in its buffer."""

    reply_id: int


@dataclass
class EngineLoadProgress(Message):
    """The loader reports a stage; ``fraction`` is 0..1 or None when unknown."""

    pair_name: str
    text: str
    fraction: float | None


@dataclass
class EngineLoaded(Message):
    """The engine of ``pair_name`` is ready (``seconds`` to load)."""

    pair_name: str
    engine: EngineAPI
    seconds: float


@dataclass
class EngineLoadFailed(Message):
    """Loading ``pair_name`` failed; ``error`` is a SpecchatError for user errors, anything else is a bug."""

    pair_name: str
    error: BaseException


@dataclass
class PairInfoReady(Message):
    """The picker's memory / download estimate for one pair (computed in a thread: it imports torch)."""

    pair_name: str
    info: dict[str, Any]


@dataclass
class PromptSubmitted(Message):
    """The user pressed Enter in the prompt input."""

    text: str


@dataclass
class RecallLastMessage(Message):
    """Up arrow in the empty prompt: put the last message back in the input to edit and resend it."""
