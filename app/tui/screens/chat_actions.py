"""The chat screen's commands and actions (a mixin of :class:`ChatScreen`, split out for size).

Commands typed in the prompt: ``/edit PATH [PATH...] [request]`` (the request after the paths, on the next
lines, or in the next message), ``/file PATH [question]`` (read-only context for the message), ``/undo`` (the
last applied edit), ``/drop``, ``/new``, ``/help``; ``//text`` sends ``/text``. Quote a path that holds
spaces. ``/edit`` and ``/undo`` themselves are in edit_actions.py.

Edit and resend: Up in the empty input puts the last message back (its ``/edit`` and ``/file`` files attached
again, as they are on disk now); sending it replaces that message and everything after it, in the history
too. Emptying the input cancels that. Branch: ``f`` on a focused message starts a new chat holding the
messages before it (a user message then waits in the input, to be edited and sent) or up to it (a reply);
the old chat stays in the history unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from textual import work
from textual.containers import VerticalScroll
from textual.widgets import Static, TextArea

from specchat.app.tui.messages import BranchFrom, RecallLastMessage
from specchat.app.tui.screens.edit_actions import EditActionsMixin, split_path_argument, split_paths
from specchat.app.tui.widgets.details_panel import DetailsPanel
from specchat.app.tui.widgets.message_view import AssistantMessage, MessageView, UserMessage
from specchat.app.tui.widgets.prompt_input import PromptInput
from specchat.app.tui.widgets.stats_bar import stored_totals
from specchat.backend.errors import KVCacheFullError, SpecchatError

if TYPE_CHECKING:
    from specchat.app.chat.conversation import Turn
    from specchat.app.tui.bridge import ReplyOutcome

log = logging.getLogger("specchat.app.tui.screens.chat")

__all__ = ["COMMANDS_HELP", "WELCOME", "ChatActionsMixin", "split_path_argument"]

WELCOME = (
    "[b]specchat[/b] — chat with a local model, sped up by speculative decoding.\n"
    "Type a message and press Enter · [b]/edit PATH[/b] to edit a file · [b]↑[/b] edits your last message · "
    "[b]F1[/b] help · [b]F2[/b] model pair · [b]F4[/b] history"
)
COMMANDS_HELP = (
    "/edit PATH..., /file PATH, /undo, /drop, /new, /help (start with // to send a message that begins with /)"
)


class ChatActionsMixin(EditActionsMixin):
    # -- slash commands --------------------------------------------------------------------------------------
    async def run_command(self, text: str) -> bool:
        """Run a slash command; True when the input should be cleared (the command was accepted)."""
        from specchat.app.chat.editing import build_file_context

        first, _, rest = text.partition("\n")
        command, _, argument = first.strip().partition(" ")
        if command in ("/edit", "/file"):
            paths, inline = split_paths(argument) if command == "/edit" else split_path_argument(argument)
            paths = [paths] if isinstance(paths, str) else paths
            request = "\n".join(part for part in (inline, rest.strip()) if part)
            if not any(paths):
                self.notify(
                    f"{command} needs a file path, e.g. {command} src/main.py",
                    title=command,
                    severity="error",
                    timeout=6,
                )
                return False
            try:
                if command == "/edit":
                    self.attach_edit(paths, request)
                    if not request:
                        names = ", ".join(paths)
                        self.notify(f"Editing {names}: describe the change and press Enter.", timeout=4)
                else:
                    path = paths[0]
                    self.pending_files.append((Path(path).name, build_file_context(path), str(Path(path).absolute())))
                    self.update_attachments()
            except SpecchatError as error:
                self.notify(str(error), title=command, severity="error", timeout=10)
                return False
            if request:
                await self.send(request)
            return True
        if command == "/undo":
            self.undo_last_edit()
            return True
        if command == "/drop":
            self.pending_files, self.pending_edits, self.resend_from = [], [], None
            self.update_attachments()
            return True
        if command == "/new":
            await self.new_chat()
            return True
        if command == "/help":
            self.app.action_help()
            return True
        self.notify(
            f"Unknown command {command}. Commands: {COMMANDS_HELP}.", title="Command", severity="error", timeout=8
        )
        return False

    def update_attachments(self) -> None:
        chip = self.query_one("#attachments", Static)
        parts = [f"📎 {name}" for name, _, _ in self.pending_files]
        for target in self.pending_edits:
            parts.append(f"✎ editing {target.shown}")
        if self.pending_edits:
            parts[-1] += ": describe the change"
        if self.resend_from is not None:
            parts.insert(0, "↺ editing your last message: Enter sends it in place of the old one and its reply")
        chip.update("  ".join(parts) + ("   (/drop detaches)" if parts else ""))
        chip.display = bool(parts)

    # -- edit and resend, branches -------------------------------------------------------------------------------
    def _reattach(self, turn: Turn) -> None:
        """Attach the files of ``turn`` again (as they are on disk now); problems are notified."""
        from specchat.app.chat.editing import build_file_context, load_edit_target

        self.pending_files, self.pending_edits = [], []
        for path in turn.paths("files"):
            try:
                self.pending_files.append((Path(path).name, build_file_context(path), path))
            except SpecchatError as error:
                self.notify(str(error), title="/file", severity="warning", timeout=8)
        for path in turn.paths("edit"):
            try:
                self.pending_edits.append(load_edit_target(path))
            except SpecchatError as error:
                self.notify(str(error), title="/edit", severity="warning", timeout=8)

    def _put_in_prompt(self, text: str) -> None:
        prompt = self.query_one(PromptInput)
        prompt.text = text
        prompt.move_cursor(prompt.document.end)
        prompt.focus()

    def on_recall_last_message(self, message: RecallLastMessage) -> None:
        index = next((i for i in range(len(self.conv.turns) - 1, -1, -1) if self.conv.turns[i].role == "user"), None)
        if index is None:
            self.notify("There is no message to edit yet.", timeout=3)
            return
        turn = self.conv.turns[index]
        self._reattach(turn)
        self.resend_from = index
        self._put_in_prompt(turn.request)
        self.update_attachments()

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if self.resend_from is not None and isinstance(event.text_area, PromptInput) and not event.text_area.text:
            self.resend_from = None  # emptied: what comes next is a new message
            self.update_attachments()

    async def replace_from(self, index: int) -> None:
        """Drop message ``index`` and everything after it, on screen and in the history (edit and resend)."""
        await self.stop_generation()
        scroll = self.query_one("#conversation", VerticalScroll)
        views = list(scroll.query(MessageView))
        if index < len(views):
            children = list(scroll.children)
            await scroll.remove_children(children[children.index(views[index]) :])
        self.conv.truncate(index)

    async def on_branch_from(self, message: BranchFrom) -> None:
        views = list(self.query_one("#conversation", VerticalScroll).query(MessageView))
        if message.view not in views:
            return
        index = views.index(message.view)
        await self.stop_generation()
        turn = self.conv.turns[index] if index < len(self.conv.turns) else None
        if turn is None:
            return
        keep = index if turn.role == "user" else index + 1
        old_title = self.conv.title
        self.conv.branch(keep, self.app.current_pair_name or "")
        await self.show_turns()
        if turn.role == "user":
            self._reattach(turn)
            self._put_in_prompt(turn.request)
            self.update_attachments()
        self.notify(
            f"A new chat branches from “{old_title}” with its first {keep} message(s); the old chat is "
            "unchanged in the history (F4).",
            title="Branch",
            timeout=8,
        )

    # -- how a reply ended --------------------------------------------------------------------------------------
    def _report(self, outcome: ReplyOutcome) -> None:
        reason, error = outcome.finish_reason, outcome.error
        if reason == "error":
            if isinstance(error, KVCacheFullError):
                self.notify(
                    f"{error} Start a new chat (Ctrl+N) or shorten the conversation; the partial reply was kept.",
                    title="Context full",
                    severity="error",
                    timeout=12,
                )
            elif error is None or isinstance(error, SpecchatError):
                reason_text = (outcome.message or "unknown error").rstrip(".")
                self.notify(
                    f"{reason_text}. The partial reply was kept; press Ctrl+R to try again, or ↑ in the empty "
                    "input to edit your message and send it again.",
                    title="Reply failed",
                    severity="error",
                    timeout=12,
                )
            else:
                log.error("unexpected error during a reply", exc_info=error)
                self.notify(
                    f"Internal error: {type(error).__name__}: {error}. The partial reply was kept; the "
                    f"traceback is in {self.app.log_path}.",
                    title="Reply failed",
                    severity="error",
                    timeout=12,
                )
        elif reason == "context":
            self.notify(
                outcome.message
                or "The conversation no longer fits in the model's context. Start a new chat (Ctrl+N) to go on.",
                title="Context full",
                severity="warning",
                timeout=12,
            )
        elif outcome.message:
            self.notify(outcome.message, timeout=6)

    # -- conversation management -------------------------------------------------------------------------------
    async def clear_messages(self) -> None:
        scroll = self.query_one("#conversation", VerticalScroll)
        await scroll.remove_children()
        await scroll.mount(Static(WELCOME, id="welcome"))

    async def new_chat(self) -> None:
        await self.stop_generation()
        self.conv.new()
        self.pending_files, self.pending_edits, self._waiting_reply, self.resend_from = [], [], False, None
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
        self.pending_files, self.pending_edits, self._waiting_reply, self.resend_from = [], [], False, None
        self.update_attachments()
        current = self.app.current_pair_name
        if current and stored_pair and current not in stored_pair.split(", "):
            self.notify(f"This chat was with {stored_pair}; it goes on with {current} (F2 switches pairs).", timeout=6)
        await self.show_turns()

    async def show_turns(self) -> None:
        """Show the conversation's turns (an opened chat, a branch)."""
        views: list[MessageView] = []
        for turn in self.conv.turns:
            if turn.role == "user":
                views.append(UserMessage(turn.display, turn.content))
            else:
                said = turn.complete or turn.meta.get("finish_reason") in ("cancelled", "error")  # its totals say so
                totals = stored_totals(turn.meta) + ("" if said else " · interrupted")
                views.append(
                    AssistantMessage(
                        header=f"Assistant · {turn.meta.get('pair', '')}".rstrip(" ·"),
                        text=turn.content,
                        totals=totals.strip(" ·"),
                        token_view=self.token_view,
                    )
                )
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
        await self.start_reply(self.last_edit_request())

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
