"""Markdown export of a stored chat: :func:`render_markdown` (the document), :func:`export_markdown` (to a
file, or to ``<title>.md`` in a folder) and :func:`suggested_path` (the documents folder's ``<title>.md``, the
place the UI proposes).

Contract: the document starts with ``# <title>``, then the pair, the start date and the message count, then
one ``## <role> · <date>`` section per message; a reply saved incomplete is marked "reply interrupted", and a
reply's scalar statistics follow it on one line (lists and dicts are left out). The file is written with
``specchat.backend.files.write_atomic`` (an existing file is replaced whole or not at all); a read-only file or
folder (mode bits) is not written; a failure raises :class:`~.records.StoreError` naming the path.
"""

from __future__ import annotations

import re
from pathlib import Path

from specchat.app.chat.history.records import ChatSummary, StoredMessage, StoreError, format_time
from specchat.app.chat.history.store import ChatStore
from specchat.backend.files import read_only_reason, write_atomic
from specchat.backend.paths import documents_dir, expand

_ROLE_HEADINGS = {"system": "System", "user": "You", "assistant": "Assistant"}


def _when(ts: float) -> str:
    return format_time(ts)


def _stats_line(stats: dict) -> str:
    parts = []
    for key, value in stats.items():
        if isinstance(value, bool) or isinstance(value, (int, str)):
            parts.append(f"{key}: {value}")
        elif isinstance(value, float):
            parts.append(f"{key}: {value:.3g}")
    return " · ".join(parts)


def render_markdown(chat: ChatSummary, messages: list[StoredMessage]) -> str:
    """The chat as a Markdown document: title, pair and dates, then one section per message."""
    lines = [
        f"# {chat.title}",
        "",
        f"*Model pair `{chat.pair}` · started {_when(chat.created_at)} · "
        f"{len(messages)} messages · exported from specchat*",
        "",
    ]
    for message in messages:
        lines += [f"## {_ROLE_HEADINGS.get(message.role, message.role)} · {_when(message.created_at)}", ""]
        lines += [message.content.rstrip("\n"), ""]
        if not message.complete:
            lines += ["*(reply interrupted: partial text)*", ""]
        if message.stats:
            summary = _stats_line(message.stats)
            if summary:
                lines += [f"*{summary}*", ""]
    return "\n".join(lines)


def file_stem(title: str) -> str:
    """A file name (no suffix) from a chat's title: letters, digits, ``.``, ``_`` and ``-`` only."""
    return re.sub(r"[^\w.-]+", "-", title).strip("-.")[:60] or "chat"


def suggested_path(title: str, folder: Path | None = None) -> Path:
    """Where to propose exporting the chat ``title``: ``<folder>/<title>.md`` in the documents folder
    (``paths.documents_dir``), ``-2``, ``-3``... added until the name is new (the proposal never replaces a file)."""
    folder = folder if folder is not None else documents_dir()
    stem, n = file_stem(title), 1
    target = folder / f"{stem}.md"
    while target.exists():
        n += 1
        target = folder / f"{stem}-{n}.md"
    return target


def export_markdown(store: ChatStore, chat_id: int, path: Path | str) -> Path:
    """Write the chat as Markdown to ``path`` (a folder: ``<folder>/<title>.md``); returns the file written."""
    summary = store.chat(chat_id)
    text = render_markdown(summary, store.messages(chat_id))
    target = expand(path)
    if target.is_dir():
        target = target / f"{file_stem(summary.title)}.md"
    reason = read_only_reason(target)  # the user's permissions hold for root too
    if reason is not None:
        raise StoreError(f"could not export the chat to {target}: {reason}. Choose a folder you can write to.")
    try:
        write_atomic(target, text)
    except OSError as exc:
        raise StoreError(
            f"could not export the chat to {target}: {exc.strerror or exc}. Choose a folder you can write to."
        ) from exc
    return target
