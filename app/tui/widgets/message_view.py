"""Chat message widgets: a user message and an assistant reply that streams Markdown.

Contract: :class:`AssistantMessage` receives text on the UI thread only (``append`` takes it, ``show_pending``
draws it: the chat screen calls that a few times a second, not per token). While it streams, the text is drawn
by a :class:`StreamTail`, which repaints without a layout pass of the screen (see ``stream_tail``); when the
tail must grow, its finished top-level Markdown blocks move to the Textual ``Markdown`` widget, which parses,
highlights and mounts each once; at the end the rest follows. The message keeps the (token text, source) pairs
for the accepted-token view, which colours each token by its :class:`TokenSource` under a legend. Code blocks
copy themselves to the clipboard on click; a focused message copies itself with ``c``, its last code block
with ``b``, and ``f`` branches the chat from it (:class:`BranchFrom`: the screen decides). A user message is
shown as the text that was typed or pasted, line breaks and indentation kept (not parsed as Markdown). While a
reply waits for its first token its totals line says what is happening (``show_status``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets._markdown import MarkdownBlock, MarkdownFence

from specchat.app.tui.widgets.edit_block import TOKEN_TYPE, ApplyEdit, EditBlockView
from specchat.app.tui.widgets.stream_tail import StreamTail, parser, split_finished
from specchat.backend.api import TokenSource
from specchat.backend.redact import terminal_safe

if TYPE_CHECKING:
    from markdown_it.token import Token

SOURCE_STYLES: dict[TokenSource, str] = {
    TokenSource.ACCEPTED: "bold green",
    TokenSource.RECOVERED: "bold yellow",
    TokenSource.BONUS: "bold magenta",
    TokenSource.TARGET: "",
}
SOURCE_LABELS: dict[TokenSource, str] = {
    TokenSource.ACCEPTED: "accepted draft",
    TokenSource.RECOVERED: "recovered at a rejection",
    TokenSource.BONUS: "bonus",
    TokenSource.TARGET: "plain target",
}
LONG_USER_LINES = 15  # longer user messages (pasted files) start collapsed


def legend() -> Text:
    text = Text("Token sources: ", style="dim")
    for source in (TokenSource.ACCEPTED, TokenSource.RECOVERED, TokenSource.BONUS, TokenSource.TARGET):
        text.append("■ ", style=SOURCE_STYLES[source] or "default")
        text.append(SOURCE_LABELS[source] + "  ")
    return text


def render_tokens(tokens: list[tuple[str, TokenSource]]) -> Text:
    text = Text()
    for piece, source in tokens:
        if piece:
            text.append(terminal_safe(piece), style=SOURCE_STYLES.get(source, ""))
    return text


WARM_LANGUAGES = ("python",)  # the language most replies' code blocks use (the pair defaults target code)


def warm_highlighting() -> None:
    """Build the Pygments lexers of ``WARM_LANGUAGES`` now (a visible pause each, longer under load):
    Pygments compiles a lexer's regular expressions the first time it is used, which would otherwise happen
    inside the first reply with a code block, on the UI thread, while the engine decodes."""
    for language in WARM_LANGUAGES:
        CopyableFence.highlight("pass", language)


class CopyableFence(MarkdownFence):
    """A code block that copies its code when clicked.

    An untagged block is shown as plain text: guessing its language (Pygments tries every lexer) costs more per
    update of a long block than the time between two updates of a streaming one (``benchmarks/RESULTS.md``,
    "Figures moved out of the code").
    """

    @classmethod
    def highlight(cls, code: str, language: str, ansi: bool = False, dark: bool = False) -> Content:
        return super().highlight(code, language or "text", ansi=ansi, dark=dark)

    def on_click(self) -> None:
        self.app.copy_to_clipboard(self.code)
        self.app.notify(f"Copied the code block ({len(self.code.splitlines())} lines).", timeout=2)


class ChatMarkdown(Markdown):
    """A reply's Markdown: code blocks copy on click, SEARCH/REPLACE blocks are edits (``edit_block.py``)."""

    BLOCKS = {**Markdown.BLOCKS, "fence": CopyableFence, "code_block": CopyableFence}

    def __init__(self, markdown: str = "", **kwargs: Any) -> None:
        super().__init__(markdown, parser_factory=parser, **kwargs)

    def unhandled_token(self, token: Token) -> MarkdownBlock | None:
        return EditBlockView(self, token) if token.type == TOKEN_TYPE else None


@dataclass
class BranchFrom(Message):
    """A message view asks for a new chat branching from it (its ``index`` among the chat's messages is found
    by the screen)."""

    view: MessageView


class MessageView(Vertical, can_focus=True):
    """Base of both message kinds: focusable, copyable."""

    BINDINGS = [
        Binding("c", "copy_message", "Copy message"),
        Binding("b", "copy_code", "Copy code block"),
        Binding("f", "branch", "Branch from here"),
    ]

    def action_branch(self) -> None:
        self.post_message(BranchFrom(self))

    def message_text(self) -> str:
        raise NotImplementedError

    def code_blocks(self) -> list[str]:
        """The code of each code block and SEARCH/REPLACE block, in the order shown."""
        return [
            block.code
            for block in self.query("MarkdownFence, EditBlockView")
            if isinstance(block, (MarkdownFence, EditBlockView))
        ]

    def action_copy_message(self) -> None:
        self.app.copy_to_clipboard(self.message_text())
        self.app.notify("Copied the message.", timeout=2)

    def action_copy_code(self) -> None:
        blocks = self.code_blocks()
        if not blocks:
            self.app.notify("This message has no code block.", severity="warning", timeout=3)
            return
        self.app.copy_to_clipboard(blocks[-1])
        self.app.notify(f"Copied the code block ({len(blocks[-1].splitlines())} lines).", timeout=2)


class UserMessage(MessageView):
    def __init__(self, display: str, content: str) -> None:
        super().__init__(classes="message user")
        self.display_text, self.content = terminal_safe(display), content  # shown: no terminal escapes

    def message_text(self) -> str:
        return self.content

    def code_blocks(self) -> list[str]:
        from specchat.app.chat.editing import code_blocks

        return [block.text for block in code_blocks(self.display_text)]

    def compose(self) -> ComposeResult:
        yield Label("You", classes="role")
        lines = self.display_text.split("\n")
        body = Static(Text(self.display_text), classes="user-text", markup=False)
        if len(lines) > LONG_USER_LINES:
            title = f"{lines[0][:70]} … ({len(lines)} lines)"
            # Text, not str: user text is never parsed as markup (Textual takes any ContentText, annotates str)
            with Collapsible(title=Text(title), collapsed=True):  # type: ignore[arg-type]
                yield body
        else:
            yield body


class AssistantMessage(MessageView):
    """A reply; streams while ``streaming`` and shows its totals line once finished. ``a`` applies its
    SEARCH/REPLACE blocks (as their Apply button does)."""

    BINDINGS = [Binding("a", "apply_edit", "Apply edit")]

    def action_apply_edit(self) -> None:
        if not self.query(EditBlockView):
            self.app.notify("This reply has no SEARCH/REPLACE block to apply.", severity="warning", timeout=3)
            return
        self.post_message(ApplyEdit(self))

    def __init__(self, *, header: str, text: str = "", totals: str = "", token_view: bool = False) -> None:
        super().__init__(classes="message assistant")
        # What is shown never carries terminal escapes (a reply loaded from the history file, a model's output);
        # /edit applies the stored reply (the conversation's turns), not this text.
        self.header, self.text, self.totals = terminal_safe(header), terminal_safe(text), terminal_safe(totals)
        self.tokens: list[tuple[str, TokenSource]] = []
        self.token_view = token_view
        self.streaming = False
        self._open = ""  # text the Markdown widget does not have yet: the StreamTail draws it
        self._unshown = ""  # appended text not drawn yet
        self._tokens_unshown = False

    def message_text(self) -> str:
        return self.text

    def compose(self) -> ComposeResult:
        yield Label(self.header, classes="role", markup=False)
        yield ChatMarkdown(self.text, id="body")
        yield StreamTail(id="tail")
        with Vertical(id="token-view"):
            yield Static(legend(), id="legend")
            yield Static(id="tokens")
        yield Static(self.totals, id="totals", classes="totals", markup=False)

    def on_mount(self) -> None:
        self._apply_view()

    def start_stream(self) -> None:
        self.streaming = True
        self.add_class("streaming")
        self._apply_view()

    def append(self, text: str, tokens: list[tuple[str, TokenSource]]) -> None:
        """Take new text and tokens; they are drawn at the next :meth:`show_pending` (the screen paces that)."""
        self.tokens.extend(tokens)
        text = terminal_safe(text)
        self.text += text
        self._unshown += text
        self._tokens_unshown = self._tokens_unshown or bool(tokens)

    async def show_pending(self) -> None:
        """Draw what :meth:`append` took since the last call. It is repainted in the tail if it fits there;
        otherwise the finished blocks move to the Markdown widget and the tail takes a step of height: one
        layout pass of the screen for both."""
        text, self._unshown = self._unshown, ""
        if text and self.streaming:
            self._open += text
            tail = self.query_one(StreamTail)
            if not tail.fits(self._open):
                await self._move_finished_blocks(split_finished(self._open, tail.md))
            if not self.token_view:
                tail.show(self._open)
        if self.token_view and self._tokens_unshown:
            self._render_tokens()
        self._tokens_unshown = False

    async def _move_finished_blocks(self, length: int) -> None:
        """Hand the first ``length`` characters of the tail's text to the Markdown widget (parsed, highlighted
        and mounted once)."""
        if length:
            await self.query_one("#body", ChatMarkdown).append(self._open[:length])
            self._open = self._open[length:]
            self.query_one(StreamTail).after_blocks = True

    async def finish(self, totals: str) -> None:
        await self.show_pending()
        if self.streaming:
            self.streaming = False
            await self._move_finished_blocks(len(self._open))
            self.query_one(StreamTail).show("")
        self.remove_class("streaming")
        self._apply_view()
        self.totals = totals
        self.query_one("#totals", Static).update(totals)

    def show_status(self, text: str) -> None:
        """A note in the totals line while no token has come yet ("reading prompt ..."); "" clears it."""
        if self.streaming and text != self.totals:
            self.totals = text
            self.query_one("#totals", Static).update(text)

    def set_token_view(self, on: bool) -> None:
        self.token_view = on
        self._apply_view()

    def _apply_view(self) -> None:
        self.query_one("#body").display = not self.token_view
        tail = self.query_one(StreamTail)
        tail.display = self.streaming and not self.token_view
        if tail.display:
            tail.show(self._open)
        self.query_one("#token-view").display = self.token_view
        if self.token_view:
            self._render_tokens()

    def _render_tokens(self) -> None:
        if self.tokens:
            body = render_tokens(self.tokens)
        else:
            body = Text(self.text + "\n\n") + Text(
                "(token sources are only known for replies made in this session)", style="dim italic"
            )
        self.query_one("#tokens", Static).update(body)
