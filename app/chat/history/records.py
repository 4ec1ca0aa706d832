"""What the chat history holds, shared by the store, the saver, the export and the UI: the rows
(:class:`ChatSummary`, :class:`StoredMessage`), their error (:class:`StoreError`) and how a message's statistics
are kept (JSON text in the ``stats`` column, read back with bounded size and depth; an unreadable value reads
back as None, never hiding the message).

The rows' input boundary: :func:`summary_from_row` and :func:`message_from_row` turn whatever a row holds (a row
written by an older or damaged store: bytes or numbers where text belongs, text, NaN or out-of-range numbers as
times, an unknown role) into valid values: a bad time becomes :data:`UNKNOWN_TIME` (shown by
:func:`format_time` as "unknown date"), bad text is shown as it can be read, and a message with an unknown role
is skipped (None). They never raise.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from specchat.backend.errors import SpecchatError
from specchat.backend.inputs import InputError, parse_json

ROLES = ("system", "user", "assistant")
UNKNOWN_TIME = 0.0  # a time a row did not hold readably
_LAST_TIME = 253402300799.0  # 9999-12-31: time.localtime's range on every platform
MAX_STATS_CHARS = 1 << 20
MAX_TITLE_CHARS = 500


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
    if not isinstance(raw, str):
        return None
    try:
        value: Any = parse_json(raw, max_chars=MAX_STATS_CHARS, non_finite=True)
    except InputError:
        return None  # unreadable stats never hide the message itself
    return value if isinstance(value, dict) else None


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):  # a BLOB where text belongs
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def _time(value: Any) -> float:
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= _LAST_TIME
    ):
        return float(value)
    return UNKNOWN_TIME


def format_time(ts: float) -> str:
    """A row's time as "YYYY-MM-DD HH:MM" in local time, or "unknown date"."""
    if ts == UNKNOWN_TIME or not 0 < ts <= _LAST_TIME:
        return "unknown date"
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "unknown date"


def summary_from_row(row: tuple) -> ChatSummary:
    """(id, title, pair, created_at, updated_at, message_count) as a ChatSummary; never raises."""
    chat_id, title, pair, created, updated, count = row
    title = _text(title).strip() or "(untitled)"
    if len(title) > MAX_TITLE_CHARS:
        title = title[: MAX_TITLE_CHARS - 1] + "…"
    return ChatSummary(
        int(chat_id), title, _text(pair), _time(created), _time(updated), count if isinstance(count, int) else 0
    )


def message_from_row(row: tuple) -> StoredMessage | None:
    """(id, role, content, stats, created_at, complete) as a StoredMessage; None for an unknown role."""
    message_id, role, content, stats, created, complete = row
    role = _text(role)
    if role not in ROLES:
        return None
    done = complete != 0 if isinstance(complete, (int, float)) else True
    return StoredMessage(int(message_id), role, _text(content), load_stats(stats), _time(created), done)
