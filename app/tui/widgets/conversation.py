"""The conversation: the chat's messages in order (and the ``/edit`` notes between them), scrolled.

Contract: it owns what is shown of the chat and the accepted-token view switch of its replies (a new reply starts in
the current view). While it holds no message it shows the welcome text; the first message replaces it and
:meth:`clear` brings it back. Turns are the chat screen's (the :class:`~specchat.app.chat.conversation.Conversation`
keeps them); this widget only draws them: ``index`` here is a message's index among the shown messages, which is
its turn's index (notes are not messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from specchat.app.tui.widgets.message_view import AssistantMessage, MessageView, UserMessage
from specchat.app.tui.widgets.stats_bar import stored_totals

if TYPE_CHECKING:
    from textual.widget import Widget

    from specchat.app.chat.conversation import Turn

WELCOME = (
    "[b]specchat[/b] — chat with a local model, sped up by speculative decoding.\n"
    "Type a message and press Enter · [b]/edit PATH[/b] to edit a file · [b]↑[/b] edits your last message · "
    "[b]F1[/b] help · [b]F2[/b] model pair · [b]F4[/b] history"
)


def turn_view(turn: Turn, token_view: bool) -> MessageView:
    """The view of a stored turn (an opened chat, a branch): a reply shows its stored totals, and says it was
    interrupted when it neither finished nor says why it stopped."""
    if turn.role == "user":
        return UserMessage(turn.display, turn.content)
    said = turn.complete or turn.meta.get("finish_reason") in ("cancelled", "error")  # its totals say so
    totals = stored_totals(turn.meta) + ("" if said else " · interrupted")
    return AssistantMessage(
        header=f"Assistant · {turn.meta.get('pair', '')}".rstrip(" ·"),
        text=turn.content,
        totals=totals.strip(" ·"),
        token_view=token_view,
    )


class ConversationView(VerticalScroll):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.token_view = False  # replies coloured by token source (Ctrl+T) instead of Markdown

    def compose(self) -> ComposeResult:
        yield Static(WELCOME, id="welcome")

    # -- what is shown -----------------------------------------------------------------------------------------
    def messages(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def last_reply(self) -> AssistantMessage | None:
        replies = list(self.query(AssistantMessage))
        return replies[-1] if replies else None

    async def add(self, *views: Widget) -> None:
        """Mount ``views`` at the end (the welcome text goes at the first)."""
        for welcome in self.query("#welcome"):
            await welcome.remove()
        await self.mount_all(views)

    async def add_reply(self, header: str) -> AssistantMessage:
        """Mount a new reply, in the current token view, ready to stream."""
        view = AssistantMessage(header=header, token_view=self.token_view)
        await self.add(view)
        view.start_stream()
        return view

    def add_note(self, note: Widget) -> None:
        """Mount a note (an ``/edit`` outcome) at the end and follow it."""
        self.mount(note)
        self.anchor()

    async def clear(self) -> None:
        """Remove everything; the welcome text comes back."""
        await self.remove_children()
        await self.mount(Static(WELCOME, id="welcome"))

    async def show(self, turns: Sequence[Turn]) -> None:
        """Show ``turns`` in place of what is shown, following the end."""
        views = [turn_view(turn, self.token_view) for turn in turns]
        await self.clear()
        if views:
            await self.add(*views)
        self.anchor()

    async def remove_from(self, index: int) -> None:
        """Remove message ``index`` and everything after it (notes included)."""
        views = self.messages()
        if index < len(views):
            children = list(self.children)
            await self.remove_children(children[children.index(views[index]) :])

    async def remove_last_reply(self) -> None:
        """Remove the last message if it is a reply (a reply being regenerated)."""
        views = self.messages()
        if views and isinstance(views[-1], AssistantMessage):
            await views[-1].remove()

    def toggle_token_view(self) -> None:
        self.token_view = not self.token_view
        for view in self.query(AssistantMessage):
            view.set_token_view(self.token_view)
