"""What the chat history holds, shared by the store, the saver, the export and the UI: the rows
(:class:`ChatSummary`, :class:`StoredMessage`), their error (:class:`StoreError`) and how a message's statistics
are kept (JSON text in the ``stats`` column; an unreadable value reads back as None, never hiding the message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specchat.backend.errors import SpecchatError

ROLES = ("system", "user", "assistant")


class StoreError(SpecchatError):
    """The history could not be read or written; the message names the file and what to do."""


@dataclass(frozen=True, slots=True)
class ChatSummary:
    id: int
    title: str
    pair: str
    created_at: float  # Unix seconds
    updated_at: float  # Unix seconds: last message added or changed
    message_count: int


@dataclass(frozen=True, slots=True)
class StoredMessage:
    id: int
    role: str  # "system" | "user" | "assistant"
    content: str
    stats: dict | None  # the reply's RequestStats.to_dict() plus finish_reason and pair (backend/api.py), or None
    created_at: float  # Unix seconds
    complete: bool  # False: a reply saved while streaming, or stopped / killed before it finished


def dump_stats(stats: dict | None) -> str | None:
    """A message's stats as the text of its ``stats`` column (None stays NULL)."""
    return None if stats is None else json.dumps(stats, default=str)


def load_stats(raw: str | None) -> dict | None:
    """The ``stats`` column read back: a dict, or None when NULL or unreadable."""
    if raw is None:
        return None
    try:
        value: Any = json.loads(raw)
    except ValueError:
        return None  # unreadable stats never hide the message itself
    return value if isinstance(value, dict) else None
