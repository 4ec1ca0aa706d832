"""The chat screen's user actions and slash commands (a mixin of :class:`ChatScreen`, split out for size).

Commands typed in the prompt: ``/edit PATH [request]`` (the request after the path, on the next lines, or
in the next message), ``/file PATH [question]`` (read-only context for the message), ``/drop``, ``/new``,
``/help``; ``//text`` sends ``/text``. Quote a path that holds spaces. The reply to an ``/edit`` request is
shown as a diff against the file and written only after the user confirms (:func:`apply_edit` keeps a backup).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual import work
from textual.containers import VerticalScroll
from textual.widgets import Static

from specchat.app.tui.screens.dialogs import DiffScreen
from specchat.app.tui.widgets.details_panel import DetailsPanel
from specchat.app.tui.widgets.message_view import AssistantMessage, MessageView, UserMessage
from specchat.app.tui.widgets.prompt_input import PromptInput
from specchat.app.tui.widgets.stats_bar import stored_totals
from specchat.backend.errors import SpecchatError

if TYPE_CHECKING:
    from specchat.app.chat.editing import EditTarget

WELCOME = ("[b]specchat[/b] — chat with a local model, sped up by speculative decoding.\n"
           "Type a message and press Enter · [b]/edit PATH[/b] to edit a file · [b]F1[/b] help · "
           "[b]F2[/b] model pair · [b]F4[/b] history")
COMMANDS_HELP = "/edit PATH, /file PATH, /drop, /new, /help (start with // to send a message that begins with /)"


def split_path_argument(text: str) -> tuple[str, str]:
    """``PATH [request]`` -> (path, request). A quoted path may hold spaces; an unquoted argument that names
    an existing file is taken whole (spaces included); otherwise the path ends at the first space."""
    text = text.strip()
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        if end > 0:
            return text[1:end], text[end + 1:].strip()
    if not text or Path(text).expanduser().exists():
        return text, ""
    path, _, request = text.partition(" ")
    return path, request.strip()


class ChatActionsMixin:
    # -- slash commands --------------------------------------------------------------------------------------
    async def run_command(self, text: str) -> bool:
        """Run a slash command; True when the input should be cleared (the command was accepted)."""
        from specchat.app.chat.editing import build_file_context, check_writable, load_edit_target

        first, _, rest = text.partition("\n")
        command, _, argument = first.strip().partition(" ")
        path, inline = split_path_argument(argument)
        request = "\n".join(part for part in (inline, rest.strip()) if part)
        if command in ("/edit", "/file") and not path:
            self.notify(f"{command} needs a file path, e.g. {command} src/main.py", title=command,
                        severity="error", timeout=6)
            return False
        try:
            if command == "/edit":
                target = load_edit_target(path)
                check_writable(target)
                self.pending_edit = target
                self.update_attachments()
                if request:
                    await self.send(request)
                else:
                    self.notify(f"Editing {path}: describe the change and press Enter.", timeout=4)
                return True
            if command == "/file":
                context = build_file_context(path)
                self.pending_files.append((Path(path).name, context))
                self.update_attachments()
                if request:
                    await self.send(request)
                return True
        except SpecchatError as error:
            self.notify(str(error), title=command, severity="error", timeout=10)
            return False
        if command == "/drop":
            self.pending_files, self.pending_edit = [], None
            self.update_attachments()
            return True
        if command == "/new":
            await self.new_chat()
            return True
        if command == "/help":
            self.app.action_help()
            return True
        self.notify(f"Unknown command {command}. Commands: {COMMANDS_HELP}.", title="Command", severity="error",
                    timeout=8)
        return False

    def update_attachments(self) -> None:
        chip = self.query_one("#attachments", Static)
        parts = [f"📎 {name}" for name, _ in self.pending_files]
        if self.pending_edit is not None:
            parts.append(f"✎ editing {self.pending_edit.display or self.pending_edit.path}: describe the change")
        chip.update("  ".join(parts) + ("   (/drop detaches)" if parts else ""))
        chip.display = bool(parts)

    # -- edits -----------------------------------------------------------------------------------------------
    @work(exclusive=True, group="edit")
    async def offer_edit(self, target: EditTarget, reply_text: str) -> None:
        """Show the reply's code block as a diff against ``target`` and write it if the user confirms."""
        from specchat.app.chat.editing import apply_edit, extract_code_block, unified_diff

        shown = target.display or str(target.path)
        code = extract_code_block(reply_text, target.language)
        if code is None:
            self.notify(f"The reply has no code block to apply to {shown}. Ask again, or press Ctrl+R.",
                        title="/edit", severity="warning", timeout=8)
            return
        diff = unified_diff(target, code)
        if not diff:
            self.notify(f"The reply's code is the same as {shown}; nothing to apply.", title="/edit", timeout=6)
            return
        if not await self.app.push_screen_wait(DiffScreen(shown, diff)):
            self.notify(f"{shown} was left unchanged.", title="/edit", timeout=4)
            return
        try:
            backup = apply_edit(target, code)
        except SpecchatError as error:
            self.notify(str(error), title="/edit", severity="error", timeout=12)
            return
        self.notify(f"Wrote {target.path} (backup: {backup.name}).", title="Edit applied", timeout=8)

    def _last_edit_target(self) -> EditTarget | None:
        """The file of the last user message if it was an /edit request (reloaded from disk)."""
        from specchat.app.chat.editing import load_edit_target

        user = next((t for t in reversed(self.conv.turns) if t.role == "user"), None)
        if user is None or not user.meta.get("edit"):
            return None
        try:
            return load_edit_target(user.meta["edit"])
        except SpecchatError as error:
            self.notify(str(error), title="/edit", severity="error", timeout=8)
            return None

    def action_review_edit(self) -> None:
        target = self._last_edit_target()
        last = self.conv.turns[-1] if self.conv.turns else None
        if target is None or last is None or last.role != "assistant":
            self.notify("The last reply is not an answer to an /edit request.", severity="warning", timeout=5)
            return
        self.offer_edit(target, last.content)

    # -- conversation management -------------------------------------------------------------------------------
    async def clear_messages(self) -> None:
        scroll = self.query_one("#conversation", VerticalScroll)
        await scroll.remove_children()
        await scroll.mount(Static(WELCOME, id="welcome"))

    async def new_chat(self) -> None:
        await self.stop_generation()
        self.conv.new()
        self.pending_files, self.pending_edit, self._waiting_reply = [], None, False
        self.update_attachments()
        await self.clear_messages()
        self.update_title()
        self.query_one(PromptInput).focus()

    async def open_chat(self, chat_id: int) -> None:
        await self.stop_generation()
        try:
            self.conv.open(chat_id)
            stored_pair = self.conv.store.chat(chat_id).pair
        except SpecchatError as error:
            self.notify(str(error), title="Could not open the chat", severity="error", timeout=10)
            return
        self.pending_files, self.pending_edit, self._waiting_reply = [], None, False
        self.update_attachments()
        current = self.app.current_pair_name
        if current and stored_pair and stored_pair != current:
            self.notify(f"This chat was with {stored_pair}; it goes on with {current} (F2 switches pairs).",
                        timeout=6)
        views: list[MessageView] = []
        for turn in self.conv.turns:
            if turn.role == "user":
                views.append(UserMessage(turn.display, turn.content))
            else:
                totals = stored_totals(turn.meta) + ("" if turn.complete else " · interrupted")
                views.append(AssistantMessage(header=f"Assistant · {turn.meta.get('pair', '')}".rstrip(" ·"),
                                              text=turn.content, totals=totals.strip(" ·"),
                                              token_view=self.token_view))
        await self.clear_messages()
        if views:
            await self._mount_messages(*views)
        scroll = self.query_one("#conversation", VerticalScroll)
        scroll.anchor()
        self.update_title()
        self.query_one(PromptInput).focus()

    # -- actions ---------------------------------------------------------------------------------------------
    async def action_stop(self) -> None:
        await self.stop_generation()

    async def action_regenerate(self) -> None:
        await self.stop_generation()
        if not self.conv.turns:
            self.notify("Nothing to regenerate yet: send a message first.", timeout=4)
            return
        if self.conv.turns[-1].role == "assistant":
            self.conv.pop_last_reply()
            views = list(self.query_one("#conversation", VerticalScroll).query(MessageView))
            if views and isinstance(views[-1], AssistantMessage):
                await views[-1].remove()
        self.query_one("#conversation", VerticalScroll).anchor()
        await self.start_reply(self._last_edit_target())

    async def action_new_chat(self) -> None:
        await self.new_chat()

    def action_toggle_tokens(self) -> None:
        self.token_view = not self.token_view
        for view in self.query(AssistantMessage):
            view.set_token_view(self.token_view)

    def action_toggle_details(self) -> None:
        panel = self.query_one(DetailsPanel)
        panel.display = not panel.display
        if panel.display:
            panel.update_stats(self._active.live if self._active else self._last)

    def _last_reply(self) -> AssistantMessage | None:
        replies = list(self.query(AssistantMessage))
        return replies[-1] if replies else None

    def action_copy_reply(self) -> None:
        reply = self._last_reply()
        if reply is None or not reply.text:
            self.notify("There is no reply to copy yet.", severity="warning", timeout=3)
            return
        reply.action_copy_message()

    def action_copy_code(self) -> None:
        reply = self._last_reply()
        if reply is None:
            self.notify("There is no reply to copy from yet.", severity="warning", timeout=3)
            return
        reply.action_copy_code()

    @work(exclusive=True, group="export")
    async def action_export_chat(self) -> None:
        from specchat.app.tui.screens.history import export_chat

        if self.conv.chat_id is None or self.app.store is None:
            self.notify("This chat is not saved yet: send a message first.", severity="warning", timeout=4)
            return
        await export_chat(self, self.app.store, self.conv.chat_id, self.conv.title)
