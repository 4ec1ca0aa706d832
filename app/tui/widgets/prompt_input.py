"""The multi-line prompt input.

Contract: Enter posts :class:`PromptSubmitted` with the text (the screen decides what to do and clears the
input); Shift+Enter (terminals with the kitty keyboard protocol), Alt+Enter and Ctrl+J insert a newline —
Ctrl+J works in every terminal. Pasting multi-line text works as usual. Up in the empty input posts
:class:`RecallLastMessage` (edit and resend the last message, as in shells and chat apps).
"""

from __future__ import annotations

from textual import events
from textual.widgets import TextArea

from specchat.app.tui.messages import PromptSubmitted, RecallLastMessage

NEWLINE_KEYS = frozenset({"shift+enter", "alt+enter", "ctrl+j"})


class PromptInput(TextArea):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            placeholder="Message (Enter sends · Ctrl+J new line · ↑ edits the last · /edit PATH · F1)",
            id=id,
        )

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(PromptSubmitted(self.text))
            return
        if event.key == "up" and not self.text:
            event.stop()
            event.prevent_default()
            self.post_message(RecallLastMessage())
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
