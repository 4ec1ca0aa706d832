"""SEARCH/REPLACE blocks in a reply, drawn as what they are: an edit of a named file, with an Apply action.

Contract: :func:`edit_blocks_plugin` teaches a markdown-it parser (the one the reply's Markdown widget and its
:class:`~specchat.app.tui.widgets.stream_tail.StreamTail` share) a block rule, so that a SEARCH/REPLACE block (the
format ``app/chat/editing.py`` asks for, parsed for real by ``app/chat/edit_plan.py``) is one ``search_replace``
token instead of Markdown: without it, ``=======`` turns the line above into a heading and ``>>>>>>> REPLACE`` into
nested quotes. The rule takes, at the start of a block or interrupting a paragraph:

- an optional file-name line and an optional opening fence (in either order), then a ``<<<<<<< SEARCH`` line;
- without a fence: every line up to and including ``>>>>>>> REPLACE`` (or up to the next SEARCH line once the
  ``=======`` was seen, or the end of the text: a block still streaming); with a fence: every line up to and
  including its closing fence (one fence may hold several blocks).

The token's ``info`` is the file name ("" when none was written), ``content`` the lines between the file name /
fences, markers included, and ``meta["closed"]`` whether the block has ended. :class:`EditBlockView` draws the
token in the Markdown widget: a header with the file name and an Apply button (which posts :class:`ApplyEdit`:
the chat screen plans the edit and shows its diff, nothing is written before the user confirms), then the lines,
the SEARCH part red and the REPLACE part green, the markers dim. :func:`edit_block_lines` is the same picture as
Rich text, for the stream tail. Nothing here parses the edit for applying: that stays in ``edit_plan.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Button, Label, Static
from textual.widgets._markdown import MarkdownBlock

if TYPE_CHECKING:
    from markdown_it import MarkdownIt
    from markdown_it.rules_block import StateBlock
    from markdown_it.token import Token
    from textual.widgets import Markdown

TOKEN_TYPE = "search_replace"
SEARCH_LINE = re.compile(r"^\s*<{5,9}\s*SEARCH\s*$")
DIVIDER_LINE = re.compile(r"^\s*={5,9}\s*$")
REPLACE_LINE = re.compile(r"^\s*>{5,9}\s*REPLACE\s*$")
FENCE_OPEN = re.compile(r"^\s{0,3}(`{3,}|~{3,})[^`]*$")
PART_STYLES = {"marker": "dim", "search": "red", "replace": "green", "other": ""}


def file_name(line: str) -> str:
    """A file name written on a line of its own (``path/to/x.py``, ``**x.py**``, ``File: x.py``), or ""."""
    name = re.sub(r"^(?:#+|\*+|[-+] )\s*", "", line.strip())
    name = re.sub(r"^(?:file(?:name)?|path)\s*:\s*", "", name, flags=re.I)
    name = name.strip("*`'\"").rstrip(":").strip("*`'\" ")
    if not name or any(c.isspace() for c in name) or not re.search(r"[./\\]", name) or name.endswith("."):
        return ""
    if SEARCH_LINE.match(name) or DIVIDER_LINE.match(name) or REPLACE_LINE.match(name):
        return ""
    return name


def _line(state: StateBlock, line: int) -> str:
    """The line without its indentation (for matching)."""
    return state.src[state.bMarks[line] + state.tShift[line] : state.eMarks[line]]


def _raw_line(state: StateBlock, line: int) -> str:
    """The line with its indentation, less that of the enclosing block (a list item's)."""
    text = state.src[state.bMarks[line] : state.eMarks[line]]
    indent = min(state.blkIndent, len(text) - len(text.lstrip(" ")))
    return text[indent:]


def _rule(state: StateBlock, start: int, end: int, silent: bool) -> bool:
    if state.sCount[start] - state.blkIndent >= 4:
        return False  # an indented code block
    line, name, fence = start, "", ""
    for _ in range(2):  # a file name and an opening fence, in either order, before the SEARCH line
        if line >= end:
            return False
        text = _line(state, line)
        if SEARCH_LINE.match(text):
            break
        opening = FENCE_OPEN.match(text)
        if opening and not fence:
            fence, line = opening.group(1), line + 1
        elif not name and (found := file_name(text)):
            name, line = found, line + 1
        else:
            return False
    if line >= end or not SEARCH_LINE.match(_line(state, line)):
        return False
    if silent:
        return True
    body_start, closed, divided = line, False, False
    closing = re.compile(r"^\s{0,3}" + re.escape(fence[:1]) + "{" + str(len(fence)) + r",}\s*$") if fence else None
    body_end = line
    while line < end:
        text = _line(state, line)
        if closing is not None and line > body_start and closing.match(text):
            body_end, line, closed = line, line + 1, True
            break
        if closing is None:
            if divided and SEARCH_LINE.match(text):  # a new block began before this one's REPLACE line
                body_end, closed = line, True
                break
            if REPLACE_LINE.match(text):
                line += 1
                body_end, closed = line, True
                break
            divided = divided or bool(DIVIDER_LINE.match(text))
        line += 1
    else:
        body_end = line
        last = next((_line(state, n) for n in range(line - 1, body_start, -1) if _line(state, n).strip()), "")
        closed = bool(REPLACE_LINE.match(last))  # an unclosed fence after the last REPLACE: the edit is whole
    token = state.push(TOKEN_TYPE, "code", 0)
    token.info, token.markup, token.block = name, fence, True
    token.content = "".join(_raw_line(state, n) + "\n" for n in range(body_start, body_end))
    token.map = [start, line]
    token.meta = {"closed": closed}
    state.line = line
    return True


def edit_blocks_plugin(md: MarkdownIt) -> None:
    """Add the SEARCH/REPLACE rule to ``md`` (first, and able to interrupt a paragraph, a list or a quote)."""
    md.block.ruler.before(
        md.block.ruler.get_all_rules()[0], TOKEN_TYPE, _rule, {"alt": ["paragraph", "reference", "blockquote", "list"]}
    )


def classify(content: str) -> list[tuple[str, str]]:
    """(part, line) for each line of a block's content: ``marker``, ``search``, ``replace`` or ``other``."""
    part, out = "other", []
    for line in content.splitlines():
        if SEARCH_LINE.match(line):
            part = "search"
            out.append(("marker", line))
        elif DIVIDER_LINE.match(line) and part == "search":
            part = "replace"
            out.append(("marker", line))
        elif REPLACE_LINE.match(line):
            part = "other"
            out.append(("marker", line))
        else:
            out.append((part, line))
    return out


def header_text(name: str, content: str) -> Text:
    """ "✎ app.py · SEARCH/REPLACE, 2 changes" (the file name, and how many blocks it holds)."""
    count = sum(1 for line in content.splitlines() if SEARCH_LINE.match(line))
    text = Text.assemble(("✎ ", "bold yellow"), (name or "(no file named)", "bold"))
    text.append(f" · SEARCH/REPLACE{f', {count} changes' if count > 1 else ''}", style="dim")
    return text


def edit_block_lines(content: str) -> Text:
    """The block's lines, each coloured by its part (the picture both the widget and the stream tail draw)."""
    text = Text()
    for index, (part, line) in enumerate(classify(content)):
        if index:
            text.append("\n")
        text.append(line.expandtabs(4), style=PART_STYLES[part])
    return text


@dataclass
class ApplyEdit(Message):
    """The user asked to apply the edit blocks of the reply that is, or holds, ``source`` (an edit block's Apply
    button, or ``a`` on a focused reply): the screen finds the reply."""

    source: Widget


class EditBlockView(MarkdownBlock):
    """A SEARCH/REPLACE token in the reply's Markdown widget (see the module docstring)."""

    DEFAULT_CSS = """
    EditBlockView {
        height: auto;
        margin: 1 0;
        background: black 10%;
        &:light { background: white 30%; }
    }
    EditBlockView > .edit-block-header {
        height: 1;
        padding: 0 1;
        background: $panel;
    }
    EditBlockView .edit-block-title {
        width: 1fr;
    }
    EditBlockView Button {
        min-width: 9;
    }
    EditBlockView > .edit-block-body {
        padding: 1 2;
        height: auto;
    }
    """

    def __init__(self, markdown: Markdown, token: Token) -> None:
        super().__init__(markdown, token)
        self.file_name, self.code = token.info, token.content
        self.closed = bool((token.meta or {}).get("closed"))

    def compose(self) -> ComposeResult:
        with Horizontal(classes="edit-block-header"):
            yield Label(header_text(self.file_name, self.code), classes="edit-block-title")
            yield Button("Apply", id="apply-edit", compact=True, variant="success", disabled=not self.closed)
        yield Static(edit_block_lines(self.code), classes="edit-block-body", markup=False)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.post_message(ApplyEdit(self))

    def build_from_token(self, token: Any) -> None:  # no inline content: compose draws it
        return None
