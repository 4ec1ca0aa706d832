"""The chat history modal: past chats to open, rename, delete (after confirmation) or export to Markdown.

Contract: dismissed with a :class:`HistoryResult` — the chat to open (or None) and the ids deleted while the
screen was open (the chat screen starts a new chat if the open one was deleted). Store errors are shown as
notifications; the list is reloaded after each change. Columns are sized to the terminal: the date and time
("2025-05-01 14:03"), the message count and each chat's own pair (the pairs that wrote its replies) show
whole; a title too long for what is left ends in "…".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.coordinate import Coordinate
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Label, Static

from specchat.app.chat.history.export import export_markdown, suggested_path
from specchat.app.chat.history.records import format_time
from specchat.app.tui.screens.dialogs import ConfirmScreen, TextPromptScreen
from specchat.backend.errors import SpecchatError
from specchat.backend.redact import terminal_safe

if TYPE_CHECKING:
    from textual.widgets.data_table import RowKey

    from specchat.app.chat.history.store import ChatStore


@dataclass
class HistoryResult:
    open_chat: int | None = None
    deleted: set[int] = field(default_factory=set)


def chat_id_of(key: RowKey) -> int:
    """The chat a table row stands for: each row is keyed by ``str(chat id)``."""
    assert key.value is not None, "history rows are keyed by their chat id"
    return int(key.value)


def when(ts: float) -> str:
    return format_time(ts)  # a damaged row's time reads "unknown date"


async def export_chat(screen: Screen, store: ChatStore, chat_id: int, title: str) -> None:
    """Ask where to export ``chat_id`` and write it (shared with the chat screen's export command)."""
    target = await screen.app.push_screen_wait(
        TextPromptScreen(
            f"Export “{title}” to Markdown",
            str(suggested_path(title)),  # the documents folder, a new name: never the current folder unseen
            hint="Enter writes it there; or type a file name (.md) or a folder (the file is named after the chat).",
        )
    )
    if target is None:
        return
    try:
        written = export_markdown(store, chat_id, target)  # it expands ~ (never raising)
    except SpecchatError as error:
        screen.app.notify(str(error), title="Export failed", severity="error", timeout=8)
        return
    screen.app.notify(f"Exported to {written.resolve()}", title="Chat exported", timeout=12)  # the whole path


class HistoryScreen(ModalScreen[HistoryResult]):
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding("e", "export", "Export"),
    ]

    def __init__(self, store: ChatStore, current_chat: int | None) -> None:
        super().__init__(classes="dialog-screen")
        self.store, self.current_chat = store, current_chat
        self.result = HistoryResult()
        self.titles: dict[int, str] = {}
        self.title_width = 40

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide", id="history"):
            yield Label(
                "Chat history  (Enter open · r rename · d delete · e export · Esc close)", classes="dialog-title"
            )
            yield DataTable(id="chats", cursor_type="row", zebra_stripes=True)
            yield Static("", id="history-empty")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        try:
            chats = self.store.list_chats()
        except SpecchatError:
            chats = []  # reload() reports it
        dialog = min(130, self.app.size.width * 9 // 10)  # styles.tcss: .dialog.wide
        pair = min(max((len(c.pair) for c in chats), default=4), 30)
        fixed = {"pair": max(pair, 4), "messages": 8, "updated": 16}
        self.title_width = max(12, dialog - 6 - sum(fixed.values()) - 2 * (len(fixed) + 1))
        for column, width in {"title": self.title_width, **fixed}.items():
            table.add_column(column, key=column, width=width)
        self.reload()
        table.focus()

    def reload(self) -> None:
        table = self.query_one(DataTable)
        row = table.cursor_row
        table.clear()
        try:
            chats = self.store.list_chats()
        except SpecchatError as error:
            self.notify(str(error), title="History unavailable", severity="error", timeout=8)
            chats = []
        self.titles = {chat.id: chat.title for chat in chats}
        for chat in chats:
            marker = "● " if chat.id == self.current_chat else "  "
            # Text cells: titles are user text and must not be parsed as markup
            title = marker + terminal_safe(chat.title)
            if len(title) > self.title_width:
                title = title[: self.title_width - 1] + "…"
            table.add_row(
                Text(title), Text(chat.pair), str(chat.message_count), when(chat.updated_at), key=str(chat.id)
            )
        self.query_one("#history-empty", Static).update("" if chats else "No saved chats yet.")
        if chats:
            table.move_cursor(row=min(row, len(chats) - 1))

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return chat_id_of(table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.result.open_chat = chat_id_of(event.row_key)
        self.dismiss(self.result)

    def action_close(self) -> None:
        self.dismiss(self.result)

    @work(exclusive=True, group="history-action")
    async def action_rename(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return
        title = await self.app.push_screen_wait(TextPromptScreen("Rename chat", self.titles.get(chat_id, "")))
        if title is None:
            return
        try:
            self.store.rename_chat(chat_id, title)
        except SpecchatError as error:
            self.notify(str(error), title="Rename failed", severity="error", timeout=8)
        self.reload()

    @work(exclusive=True, group="history-action")
    async def action_delete(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return
        title = self.titles.get(chat_id, str(chat_id))
        if not await self.app.push_screen_wait(
            ConfirmScreen(
                "Delete chat?", f"Delete “{title}” and all its messages? This cannot be undone.", yes="Delete"
            )
        ):
            return
        try:
            self.store.delete_chat(chat_id)
        except SpecchatError as error:
            self.notify(str(error), title="Delete failed", severity="error", timeout=8)
        else:
            self.result.deleted.add(chat_id)
            self.notify(f"Deleted “{title}”.")
        self.reload()

    @work(exclusive=True, group="history-action")
    async def action_export(self) -> None:
        chat_id = self._selected()
        if chat_id is not None:
            await export_chat(self, self.store, chat_id, self.titles.get(chat_id, str(chat_id)))
