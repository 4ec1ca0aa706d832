"""The open chat: its turns, its rows in the history store, and the engine requests built from it.

Contract (UI thread only):
- A chat is created in the store with the first user message; every user message is saved at once; a reply
  is a store row created empty when it starts and saved by a :class:`StreamingSaver` while it streams (at
  least every 0.5 s) and at its end (with the stats and whether it completed).
- A user turn built from attachments (``/edit``, ``/file``) keeps what the model sees in ``content`` and a
  short ``meta`` (``request``, ``attachments``, ``edit``: the edited files' paths, ``files``: the attached
  files' paths) in the message's stats column, so a reopened chat shows the short form, can offer the diff
  again, and an edited message can attach the same files again.
- A finished reply records the pair that wrote it; the chat's pair in the history list is the pairs that wrote
  its replies ("a, b" when it changed), not the pair loaded last.
- :meth:`Conversation.truncate` drops a turn and every later one (edit and resend), in the store too;
  :meth:`Conversation.branch` starts a new chat holding copies of the first turns (the old chat is untouched).
- History failures never stop the chat: they are reported through ``on_error`` (a notification) once, not
  at every message, until a save works again (a full disk fails every write), and the conversation goes on in
  memory. A read-only history (``ChatStore.read_only``, told at start by app/cli/chat.py) is only read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from specchat.app.chat.history.saver import StreamingSaver
from specchat.app.chat.history.store import ChatStore
from specchat.backend.api import RequestStats
from specchat.backend.errors import SpecchatError

log = logging.getLogger(__name__)
TITLE_CHARS = 60
T = TypeVar("T")


@dataclass(slots=True)
class Turn:
    role: str  # "user" | "assistant"
    content: str  # what the model sees
    meta: dict[str, Any] = field(default_factory=dict)  # user: request/attachments/edit; assistant: stats
    message_id: int | None = None
    complete: bool = True

    @property
    def display(self) -> str:
        """What the chat shows for this turn: for a message with attachments, a line naming them, then the
        request (not the files' text the model sees)."""
        if self.role == "user" and "request" in self.meta:
            names = ", ".join(self.meta.get("attachments", []))
            verb = "✎ edit" if self.meta.get("edit") else "📎"
            return f"{verb} {names}\n\n{self.meta['request']}" if names else self.meta["request"]
        return self.content

    @property
    def request(self) -> str:
        """What the user typed (without the attached files' text)."""
        return str(self.meta.get("request", self.content)) if self.role == "user" else self.content

    def paths(self, key: str) -> list[str]:
        """The ``edit`` or ``files`` paths of a user turn (an older row keeps one ``edit`` path as a string)."""
        value = self.meta.get(key)
        return [value] if isinstance(value, str) else [str(v) for v in value or [] if isinstance(v, str)]


def title_for(text: str) -> str:
    first = next((line.strip() for line in text.splitlines() if line.strip()), "New chat")
    return first if len(first) <= TITLE_CHARS else first[: TITLE_CHARS - 1] + "…"


class Conversation:
    """One chat, mirrored in the store (``store`` may be None: history disabled)."""

    def __init__(self, store: ChatStore | None, on_error: Callable[[str], None]) -> None:
        self.store = store
        self.on_error = on_error
        self.chat_id: int | None = None
        self.title = "New chat"
        self.turns: list[Turn] = []
        self._scratch = 0  # conversation key of an unsaved chat
        self._failing = False  # the last history write failed and the user was told

    @property
    def key(self) -> str:
        """The engine's conversation key (paged-cache prefix reuse across turns)."""
        return f"chat-{self.chat_id}" if self.chat_id is not None else f"scratch-{self._scratch}"

    def _guard(self, what: str, call: Callable[[ChatStore], T], *, proves_saving: bool = True) -> T | None:
        """``call(store)``; None without a writable store or when it fails (reported through ``on_error`` once
        until a later call succeeds). A small update that a full disk still allows (``proves_saving`` False:
        the chat's pair) does not count as saving working again."""
        if self.store is None or self.store.read_only:
            return None
        try:
            result = call(self.store)
        except SpecchatError as error:
            log.warning("history: could not %s: %s", what, error)
            if not self._failing:
                self.on_error(
                    f"History: could not {what}: {error} The chat goes on without saving; this is not "
                    "repeated for every message."
                )
            self._failing = True
            return None
        if proves_saving:
            self._failing = False
        return result

    def new(self) -> None:
        self.chat_id, self.title, self.turns = None, "New chat", []
        self._scratch += 1

    def open(self, chat_id: int) -> None:
        """Load a stored chat (raises SpecchatError if it cannot be read: the caller keeps the current one)."""
        if self.store is None:
            return
        summary = self.store.chat(chat_id)
        turns = []
        for message in self.store.messages(chat_id):
            if message.role == "system":
                continue  # the system prompt comes from the settings
            turns.append(Turn(message.role, message.content, dict(message.stats or {}), message.id, message.complete))
        self.chat_id, self.title, self.turns = chat_id, summary.title, turns

    def add_user(self, content: str, pair_name: str, meta: dict[str, Any] | None = None) -> Turn:
        turn = Turn("user", content, dict(meta or {}))
        if self.chat_id is None and self.store is not None:
            self.title = title_for(turn.meta.get("request", content))
            self.chat_id = self._guard("create the chat", lambda store: store.create_chat(self.title, pair_name))
        if (chat_id := self.chat_id) is not None:
            turn.message_id = self._guard(
                "save your message", lambda store: store.add_message(chat_id, "user", content, turn.meta or None)
            )
        self.turns.append(turn)
        return turn

    def start_reply(self) -> tuple[Turn, StreamingSaver | None]:
        """Append an empty assistant turn; returns it and its StreamingSaver (None without history)."""
        turn = Turn("assistant", "", complete=False)
        saver: StreamingSaver | None = None
        if (chat_id := self.chat_id) is not None:
            turn.message_id = self._guard(
                "save the reply", lambda store: store.add_message(chat_id, "assistant", "", None, False)
            )
            if turn.message_id is not None and self.store is not None:
                saver = StreamingSaver(self.store, turn.message_id, interval_s=0.5)
        self.turns.append(turn)
        return turn, saver

    def finish_reply(
        self,
        turn: Turn,
        saver: StreamingSaver | None,
        text: str,
        stats: RequestStats,
        *,
        finish_reason: str,
        pair: str,
        complete: bool,
        error: str | None = None,
    ) -> None:
        """Keep the reply with its statistics: the history row's stats column is ``stats.to_dict()`` plus how the
        reply ended, the pair that wrote it and, for an error, what went wrong (the one place that record is
        built). The chat's pair becomes the pairs that wrote its replies."""
        meta = stats.to_dict() | {"finish_reason": finish_reason, "pair": pair}
        if error:
            meta["error"] = error
        turn.content, turn.meta, turn.complete = text, meta, complete
        if saver is not None:
            self._guard("save the reply", lambda _store: saver.finish(meta, complete))
        pairs = ", ".join(
            dict.fromkeys(str(t.meta["pair"]) for t in self.turns if t.role == "assistant" and t.meta.get("pair"))
        )
        if pairs:
            self.set_pair(pairs)

    def pop_last_reply(self) -> Turn | None:
        """Remove the last turn if it is a reply (regenerate); the store row goes too."""
        if not self.turns or self.turns[-1].role != "assistant":
            return None
        turn = self.turns.pop()
        if (chat_id := self.chat_id) is not None:
            self._guard("remove the old reply", lambda store: store.delete_last_assistant(chat_id))
        return turn

    def truncate(self, index: int) -> None:
        """Drop turn ``index`` and every later one (edit and resend), in the store too."""
        dropped, self.turns = self.turns[index:], self.turns[:index]
        first = next((t.message_id for t in dropped if t.message_id is not None), None)
        if (chat_id := self.chat_id) is not None and first is not None:
            self._guard("remove the old messages", lambda store: store.delete_messages_from(chat_id, first))

    def branch(self, keep: int, pair_name: str) -> None:
        """Go on in a new chat that starts with copies of the first ``keep`` turns; the old chat stays as it was."""
        turns = [Turn(t.role, t.content, dict(t.meta), None, t.complete) for t in self.turns[:keep]]
        title = (self.title if len(self.title) <= 50 else self.title[:49] + "…") + " (branch)"
        self.new()
        self.title, self.turns = title, turns
        if self.store is None or not turns:
            return
        self.chat_id = self._guard("create the branch", lambda store: store.create_chat(title, pair_name))
        if (chat_id := self.chat_id) is not None:
            for turn in turns:

                def copy(store: ChatStore, t: Turn = turn) -> int:
                    return store.add_message(chat_id, t.role, t.content, t.meta or None, t.complete)

                turn.message_id = self._guard("copy a message into the branch", copy)

    def set_pair(self, pair_name: str) -> None:
        if (chat_id := self.chat_id) is not None:
            self._guard("record the pair", lambda store: store.set_pair(chat_id, pair_name), proves_saving=False)

    def request_messages(self, system_prompt: str) -> list[dict[str, str]]:
        """The chat as chat-template messages, without an unfinished (empty) trailing reply."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        for turn in self.turns:
            if turn.role == "assistant" and not turn.content:
                continue
            messages.append({"role": turn.role, "content": turn.content})
        return messages
