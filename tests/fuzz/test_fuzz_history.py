"""Fuzzing history rows (app/chat/history/records.py ``summary_from_row`` / ``message_from_row``, issue 20 item 9):
rows an older or damaged store left — invalid UTF-8, BLOBs, numbers where text belongs, text, NaN or huge numbers
as times, unknown roles, deeply nested or broken stats JSON — are listed, opened, exported and shown without an
exception: a bad value is shown as unreadable ("unknown date", the text as it can be read) and a message with an
unknown role is skipped. Fails on the code before issue 20: invalid UTF-8 in one title made ``list_chats`` raise
(hiding every chat), a text timestamp crashed the export, deep stats JSON raised RecursionError."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from hypothesis import strategies as st
from reliability import NASTY_TEXT, SCALES, fuzz

from specchat.app.chat.conversation import Conversation
from specchat.app.chat.history.export import export_markdown, render_markdown
from specchat.app.chat.history.records import format_time
from specchat.app.chat.history.store import ChatStore


class BadText(bytes):
    """Bytes stored as TEXT (not a BLOB): what a store that wrote invalid UTF-8 leaves."""


TEXT = st.one_of(
    NASTY_TEXT, st.binary(max_size=20).map(BadText), st.binary(max_size=8), st.integers(), st.floats(allow_nan=False)
)
TIME = st.one_of(
    st.floats(allow_nan=False),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    NASTY_TEXT,
    st.binary(max_size=8),
    st.just(1.7e9),
)
ROLE = st.one_of(st.sampled_from(["user", "assistant", "system"]), TEXT)
STATS = st.one_of(
    st.none(),
    st.just('{"tok_s": 12.5, "new_tokens": 3}'),
    NASTY_TEXT,
    st.binary(max_size=8),
    st.integers(),
    st.integers(min_value=33, max_value=100_000).map(lambda n: "[" * n + "]" * n),
    st.just('{"a": ' + "9" * 5000 + "}"),
    st.just('{"x": NaN, "y": Infinity}'),
)
COMPLETE = st.one_of(st.sampled_from([0, 1]), st.integers(), NASTY_TEXT)
MESSAGE = st.tuples(ROLE, TEXT, STATS, TIME, COMPLETE)
CHAT = st.tuples(TEXT, TEXT, TIME, TIME, st.lists(MESSAGE, max_size=4))


def _sql(value: object) -> tuple[str, object]:
    if isinstance(value, str):  # a lone surrogate: its bytes, as a store that wrote them would have left them
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            value = BadText(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        value = float(value)  # SQLite's integers are 64-bit
    return ("CAST(? AS TEXT)", bytes(value)) if isinstance(value, BadText) else ("?", value)


def _insert(conn: sqlite3.Connection, chats: list) -> None:
    conn.execute("DELETE FROM messages")
    conn.execute("DELETE FROM chats")
    for title, pair, created, updated, messages in chats:
        parts = [_sql(v) for v in (title, pair, created, updated)]
        chat_id = conn.execute(
            f"INSERT INTO chats (title, pair, created_at, updated_at) VALUES ({', '.join(p for p, _ in parts)})",
            [v for _, v in parts],
        ).lastrowid
        for message in messages:
            parts = [_sql(v) for v in message]
            conn.execute(
                f"INSERT INTO messages (chat_id, role, content, stats, created_at, complete) VALUES "
                f"(?, {', '.join(p for p, _ in parts)})",
                [chat_id] + [v for _, v in parts],
            )
    conn.commit()


@SCALES
def test_damaged_rows_are_listed_opened_and_exported(tmp_path: Path, scale: int) -> None:
    db = tmp_path / "history.sqlite3"
    ChatStore(db).close()
    raw = sqlite3.connect(db)
    errors: list[str] = []

    def check(chats: list) -> None:
        _insert(raw, chats)
        with ChatStore(db) as store:
            listed = store.list_chats()
            assert len(listed) == len(chats)  # no chat hidden by another's damage
            for summary in listed:
                assert isinstance(summary.title, str) and summary.title and isinstance(summary.pair, str)
                format_time(summary.created_at), format_time(summary.updated_at)
                messages = store.messages(summary.id)
                assert all(m.role in ("system", "user", "assistant") and isinstance(m.content, str) for m in messages)
                assert all(m.stats is None or isinstance(m.stats, dict) for m in messages)
                render_markdown(store.chat(summary.id), messages).encode("utf-8")
                export_markdown(store, summary.id, tmp_path / "export.md")
                conversation = Conversation(store, errors.append)
                conversation.open(summary.id)
                conversation.request_messages("system prompt")
        assert not errors

    try:
        fuzz("history rows", st.lists(CHAT, min_size=1, max_size=3), check, 120 * scale)
    finally:
        raw.close()


def test_the_classes_of_the_issue_are_shown_as_unreadable(tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite3"
    with ChatStore(db) as store:
        good = store.create_chat("good", "p")
        store.add_message(good, "user", "kept")
    raw = sqlite3.connect(db)
    raw.execute(
        "INSERT INTO chats (title, pair, created_at, updated_at) VALUES (CAST(x'ff61' AS TEXT), 'p', "
        "'yesterday', 1e300)"
    )
    bad = raw.execute("SELECT max(id) FROM chats").fetchone()[0]
    raw.execute(
        "INSERT INTO messages (chat_id, role, content, stats, created_at) VALUES (?, 'user', 'hi', ?, 'x')",
        (bad, "[" * 50_000 + "]" * 50_000),
    )
    raw.execute("INSERT INTO messages (chat_id, role, content, created_at) VALUES (?, 'robot', 'beep', 1.0)", (bad,))
    raw.commit()
    raw.close()
    with ChatStore(db) as store:
        titles = {c.id: c for c in store.list_chats()}
        assert titles[good].title == "good" and titles[bad].title == "\ufffda"
        assert format_time(titles[bad].created_at) == "unknown date" == format_time(titles[bad].updated_at)
        (message,) = store.messages(bad)  # the 'robot' row is skipped
        assert (message.content, message.stats, format_time(message.created_at)) == ("hi", None, "unknown date")
        assert "unknown date" in export_markdown(store, bad, tmp_path / "out.md").read_text()
