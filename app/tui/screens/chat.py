"""The chat screen: the conversation, the prompt, the live statistics, composed of widgets that own their state.

Contract:
- The screen owns the :class:`~specchat.app.chat.conversation.Conversation` (the turns, saved to the history) and
  composes: a :class:`ConversationView` (what is shown of it, the token view), a :class:`DetailsPanel`, the
  :class:`Attachments` of the next message, the :class:`PromptInput`, the :class:`StatsBar`, and two non-visual
  controllers: the :class:`ReplyController` (the streaming reply and its worker: see reply_controller.py), the
  :class:`EditController` (``/edit`` outcomes and ``/undo``: see edit_controller.py) and the :class:`ChatWarmer`
  (a reopened chat read into the engine's cache before the next message: see warmer.py). It reads the app through
  :class:`~specchat.app.tui.seams.ChatHost`, handed to it.
- Enter sends the prompt's text, or runs it as a command (commands.py); a command that fails keeps the text, to
  fix. Anything that starts a reply or shows another chat stops the running reply first (partial text kept).
- Edit and resend: Up in the empty input puts the last message back (its ``/edit`` and ``/file`` files attached
  again, as they are on disk now); sending it replaces that message and everything after it, in the history
  too. Emptying the input cancels that. Branch: ``f`` on a focused message starts a new chat holding the
  messages before it (a user message then waits in the input, to be edited and sent) or up to it (a reply);
  the old chat stays in the history unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, Header, TextArea

from specchat.app.chat.conversation import Conversation
from specchat.app.tui.messages import PromptSubmitted, RecallLastMessage
from specchat.app.tui.screens.commands import COMMANDS_HELP, is_command, parse_command
from specchat.app.tui.screens.edit_controller import EditController
from specchat.app.tui.screens.reply_controller import ReplyController, ReplyViews
from specchat.app.tui.screens.warmer import ChatWarmer
from specchat.app.tui.widgets.attachments import Attachments
from specchat.app.tui.widgets.conversation import ConversationView
from specchat.app.tui.widgets.details_panel import DetailsPanel
from specchat.app.tui.widgets.edit_block import ApplyEdit
from specchat.app.tui.widgets.message_view import AssistantMessage, BranchFrom, UserMessage
from specchat.app.tui.widgets.prompt_input import PromptInput
from specchat.app.tui.widgets.stats_bar import StatsBar
from specchat.backend.errors import SpecchatError

if TYPE_CHECKING:
    from specchat.app.tui.seams import ChatHost


class ChatScreen(Screen[None]):
    BINDINGS = [
        # Not in the footer: showing it only while a reply streams would recompose the footer (a layout pass of
        # the screen: benchmarks/RESULTS.md, "Figures moved out of the code") as each reply starts; the stats bar
        # says "esc stop" while one streams.
        Binding("escape", "stop", "Stop", show=False),
        # The app's F-keys again, first: the footer lists the screen's keys before the app's, and at 80 columns
        # the last ones do not fit.
        Binding("f1", "app.help", "Help"),
        Binding("f2", "app.pick_pair", "Pair"),
        Binding("f3", "app.settings", "Settings"),
        Binding("f4", "app.history", "History"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+t", "toggle_tokens", "Token view"),
        Binding("ctrl+g", "toggle_details", "Details"),
        Binding("ctrl+o", "copy_reply", "Copy reply", show=False),
        Binding("ctrl+b", "copy_code", "Copy code", show=False),
    ]

    def __init__(self, host: ChatHost) -> None:
        super().__init__(id="chat")
        self.host = host
        self.conv = Conversation(None, self._history_error)
        self._history_warned = False
        self.conversation = ConversationView(id="conversation")
        self.details = DetailsPanel(id="details")
        self.attachments = Attachments(id="attachments")
        self.prompt = PromptInput(id="prompt")
        self.stats_bar = StatsBar(id="stats")
        self.edits = EditController(self.conversation)
        views = ReplyViews(self.conversation, self.stats_bar, self.details, self.prompt)
        self.replies = ReplyController(host, self.conv, views, offer_edit=self.edits.offer)
        self.warmer = ChatWarmer(host, self.conv, self.stats_bar)

    # -- layout ----------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="main"):
            yield self.conversation
            yield self.details
        yield self.attachments
        yield self.prompt
        yield self.stats_bar
        yield Footer()
        yield self.replies
        yield self.edits
        yield self.warmer

    def on_mount(self) -> None:
        self.conv.store = self.host.store
        self.details.display = False
        self.conversation.anchor()
        self.prompt.focus()
        self.edits.recover()

    @property
    def generating(self) -> bool:
        return self.replies.generating

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating
        return True

    def _history_error(self, message: str) -> None:
        if not self._history_warned:  # one notification, not one per token batch
            self._history_warned = True
            self.notify(
                message + " The chat goes on, but may not be saved.", title="History", severity="error", timeout=10
            )

    def update_title(self) -> None:
        self.app.sub_title = f"{self.host.current_pair_name or 'no model'} · {self.conv.title}"

    # -- what the app asks -------------------------------------------------------------------------------------
    async def stop_generation(self) -> None:
        """Stop the running reply and finish it (partial text kept, shown and saved), and the reading of a reopened
        chat (screens/warmer.py), before anything else: the engine has one owner at a time."""
        await self.warmer.stop()
        await self.replies.stop()

    async def engine_ready(self) -> None:
        """Called by the app when a model finished loading: start a reply that was waiting for it, else read the
        open chat into the new engine's cache."""
        await self.replies.engine_ready()
        if not self.generating:
            self.warmer.start()

    def engine_unavailable(self) -> None:
        self.replies.engine_unavailable()

    # -- sending -----------------------------------------------------------------------------------------------
    async def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        text = message.text
        if not text.strip():
            return
        if is_command(text):
            if await self.run_command(text):
                self.prompt.clear()
            return
        self.prompt.clear()
        index = self.attachments.take_resend()
        if index is not None:
            await self.replace_from(index)
        await self.send(text[1:] if text.startswith("//") else text)

    async def send(self, request: str) -> None:
        """Send ``request`` (with any pending attachments) and start the reply."""
        from specchat.app.chat.editing import EditError

        try:
            content, meta = self.attachments.message_for(request)
        except EditError as error:
            self.notify(str(error), title="/edit", severity="error", timeout=8)
            return
        edits = self.attachments.edits
        self.attachments.clear()
        await self.stop_generation()
        turn = self.conv.add_user(content, self.host.current_pair_name or "", meta)
        self.update_title()
        await self.conversation.add(UserMessage(turn.display, turn.content))
        self.conversation.anchor()  # a new message follows the reply again
        await self.replies.start((edits, request) if edits else None)

    async def run_command(self, text: str) -> bool:
        """Run a slash command; True when the input should be cleared (the command was accepted)."""
        command = parse_command(text)
        name, paths, request = command.name, command.paths, command.request
        if name in ("/edit", "/file"):
            if not any(paths):
                self.notify(
                    f"{name} needs a file path, e.g. {name} src/main.py", title=name, severity="error", timeout=6
                )
                return False
            try:
                if name == "/edit":
                    self.attachments.attach_edits(paths)
                    if not request:
                        self.notify(f"Editing {', '.join(paths)}: describe the change and press Enter.", timeout=4)
                else:
                    self.attachments.attach_file(paths[0])
            except SpecchatError as error:
                self.notify(str(error), title=name, severity="error", timeout=10)
                return False
            if request:
                await self.send(request)
            return True
        if name == "/undo":
            self.edits.undo()
            return True
        if name == "/drop":
            self.attachments.clear()
            return True
        if name == "/new":
            await self.new_chat()
            return True
        if name == "/help":
            self.host.action_help()
            return True
        self.notify(f"Unknown command {name}. Commands: {COMMANDS_HELP}.", title="Command", severity="error", timeout=8)
        return False

    # -- edit and resend, branches -------------------------------------------------------------------------------
    def _put_in_prompt(self, text: str) -> None:
        self.prompt.text = text
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()

    def on_recall_last_message(self, message: RecallLastMessage) -> None:
        turns = self.conv.turns
        index = next((i for i in range(len(turns) - 1, -1, -1) if turns[i].role == "user"), None)
        if index is None:
            self.notify("There is no message to edit yet.", timeout=3)
            return
        turn = turns[index]
        self.attachments.reattach(turn)
        self._put_in_prompt(turn.request)
        self.attachments.resend(index)

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if isinstance(event.text_area, PromptInput) and not event.text_area.text:
            self.attachments.cancel_resend()  # emptied: what comes next is a new message

    async def replace_from(self, index: int) -> None:
        """Drop message ``index`` and everything after it, on screen and in the history (edit and resend)."""
        await self.stop_generation()
        await self.conversation.remove_from(index)
        self.conv.truncate(index)

    async def on_branch_from(self, message: BranchFrom) -> None:
        views = self.conversation.messages()
        if message.view not in views:
            return
        index = views.index(message.view)
        await self.stop_generation()
        turn = self.conv.turns[index] if index < len(self.conv.turns) else None
        if turn is None:
            return
        keep = index if turn.role == "user" else index + 1
        old_title = self.conv.title
        self.conv.branch(keep, self.host.current_pair_name or "")
        await self.show_turns()
        if turn.role == "user":
            self.attachments.reattach(turn)
            self._put_in_prompt(turn.request)
            self.attachments.refresh_chip()
        self.notify(
            f"A new chat branches from “{old_title}” with its first {keep} message(s); the old chat is "
            "unchanged in the history (F4).",
            title="Branch",
            timeout=8,
        )

    def on_apply_edit(self, message: ApplyEdit) -> None:
        """An edit block's Apply (or ``a`` on a reply): plan that reply's blocks and show the diff."""
        source = message.source
        view = source if isinstance(source, AssistantMessage) else source.query_ancestor(AssistantMessage)
        views = self.conversation.messages()
        if view not in views or views.index(view) >= len(self.conv.turns):
            return
        if self.generating and view is self.conversation.last_reply():
            self.notify("The reply is still being written: apply it once it has ended.", timeout=4)
            return
        self.edits.apply_reply(self.conv.turns, views.index(view))

    # -- conversation management -------------------------------------------------------------------------------
    async def new_chat(self) -> None:
        await self.stop_generation()
        self.conv.new()
        self.attachments.clear()
        self.replies.forget_waiting()
        await self.conversation.clear()
        self.update_title()
        self.prompt.focus()

    async def open_chat(self, chat_id: int) -> None:
        await self.stop_generation()
        try:
            self.conv.open(chat_id)
            stored_pair = self.conv.store.chat(chat_id).pair if self.conv.store is not None else None
        except SpecchatError as error:
            self.notify(str(error), title="Could not open the chat", severity="error", timeout=10)
            return
        self.attachments.clear()
        self.replies.forget_waiting()
        current = self.host.current_pair_name
        if current and stored_pair and current not in stored_pair.split(", "):
            self.notify(f"This chat was with {stored_pair}; it goes on with {current} (F2 switches pairs).", timeout=6)
        await self.show_turns()
        self.warmer.start()  # its next reply then reads only the new message

    async def show_turns(self) -> None:
        """Show the conversation's turns (an opened chat, a branch)."""
        await self.conversation.show(self.conv.turns)
        self.update_title()
        self.prompt.focus()

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
            await self.conversation.remove_last_reply()
        self.conversation.anchor()
        await self.replies.start(self.edits.last_request(self.conv.turns))

    async def action_new_chat(self) -> None:
        await self.new_chat()

    def action_toggle_tokens(self) -> None:
        self.conversation.toggle_token_view()

    def action_toggle_details(self) -> None:
        panel = self.details
        panel.display = not panel.display
        if panel.display:
            panel.update_stats(self.replies.live)

    def action_copy_reply(self) -> None:
        reply = self.conversation.last_reply()
        if reply is None or not reply.text:
            self.notify("There is no reply to copy yet.", severity="warning", timeout=3)
            return
        reply.action_copy_message()

    def action_copy_code(self) -> None:
        reply = self.conversation.last_reply()
        if reply is None:
            self.notify("There is no reply to copy from yet.", severity="warning", timeout=3)
            return
        reply.action_copy_code()

    def action_review_edit(self) -> None:
        self.edits.review(self.conv.turns)

    @work(exclusive=True, group="export")
    async def action_export_chat(self) -> None:
        from specchat.app.tui.screens.history import export_chat

        store = self.host.store
        if self.conv.chat_id is None or store is None:
            self.notify("This chat is not saved yet: send a message first.", severity="warning", timeout=4)
            return
        await export_chat(self, store, self.conv.chat_id, self.conv.title)
