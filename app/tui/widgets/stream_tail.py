"""The open end of a streaming reply, drawn without laying out the screen.

Contract: while a reply streams, :class:`~specchat.app.tui.widgets.message_view.AssistantMessage` shows the text
that its Textual ``Markdown`` widget does not show yet in a :class:`StreamTail`. Redrawing Textual's Markdown is a
layout pass of the whole screen (dear, and taken from the decoding threads: ``benchmarks/RESULTS.md``, "Figures moved
out of the code"); the tail renders its top-level blocks itself to strips, each once while it is unchanged, and keeps
its height in steps of ``RESERVE_LINES``, so most redraws repaint its own lines only. When the text no longer fits
(:meth:`fits`), the message moves the finished blocks (:func:`split_finished`) to the Markdown widget in the same
layout pass that gives the tail its next step. A code fence is drawn here as plain code, laid out as Textual's
MarkdownFence draws it; it is highlighted once, in the Markdown widget. A SEARCH/REPLACE block (``edit_block.py``: the
parser knows it) is drawn as its widget draws it, without the Apply button until it moves. Other blocks are drawn with
Rich's Markdown. A paragraph that is only a file name stays in the tail while the block after it is the last: it
becomes the header of a SEARCH/REPLACE block if that block turns out to be one.
"""

from __future__ import annotations

from itertools import accumulate

from markdown_it import MarkdownIt
from markdown_it.token import Token
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from textual.strip import Strip
from textual.widget import Widget

from specchat.app.tui.widgets.edit_block import TOKEN_TYPE, edit_block_lines, edit_blocks_plugin, file_name, header_text

RESERVE_LINES = 8  # the tail grows (a layout pass) in steps of this many lines
FENCE_PADDING = 2  # columns left of the code, as Textual's MarkdownFence draws it


def parser() -> MarkdownIt:
    """What the reply's Markdown widget parses with: Textual's default ("gfm-like") and SEARCH/REPLACE blocks."""
    return MarkdownIt("gfm-like").use(edit_blocks_plugin)


def top_level_blocks(markdown: str, md: MarkdownIt) -> list[tuple[Token, int, int]]:
    """Each top-level block of ``markdown``: its opening token and the character span of its source (the blank
    lines after a block go with it; lines counted as Textual's Markdown.append counts them)."""
    blocks = [(token, token.map[0]) for token in md.parse(markdown) if token.level == 0 and token.map is not None]
    offsets = list(accumulate((len(line) for line in markdown.splitlines(keepends=True)), initial=0))
    starts = [offsets[first_line] for _, first_line in blocks] + [len(markdown)]
    return [(token, starts[index], starts[index + 1]) for index, (token, _) in enumerate(blocks)]


def split_finished(markdown: str, md: MarkdownIt | None = None) -> int:
    """How many leading characters of ``markdown`` are finished top-level blocks: all but the last block
    (a block is finished once the next one has started)."""
    blocks = top_level_blocks(markdown, md or parser())
    if len(blocks) >= 3 and _names_a_file(markdown, blocks[-2]):
        return blocks[-2][1]  # the file name may yet head the last block (see the module docstring)
    return blocks[-1][1] if len(blocks) >= 2 else 0


def _names_a_file(markdown: str, block: tuple[Token, int, int]) -> bool:
    token, start, end = block
    text = markdown[start:end].strip()
    return token.type == "paragraph_open" and "\n" not in text and bool(file_name(text))


def reserved_height(lines: int) -> int:
    """The tail's height for ``lines`` rendered lines: rounded up to a whole step, at least one step."""
    return max(1, -(-lines // RESERVE_LINES)) * RESERVE_LINES


class StreamTail(Widget):
    """The unfinished end of a streaming reply; see the module docstring."""

    DEFAULT_CSS = """
    StreamTail {
        height: 8;
        width: 1fr;
    }
    StreamTail > .stream-tail--code {
        color: rgb(210,210,210);
        background: black 10%;
    }
    """
    COMPONENT_CLASSES = {"stream-tail--code"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.markdown = ""
        self.after_blocks = False  # the Markdown widget above already shows blocks (their margin separates)
        self.md = parser()  # the message's block splitting uses it too
        self._blocks: dict[tuple[str, int, bool], list[Strip]] = {}  # rendered blocks of the current text
        self._lines: list[Strip] = []
        self._rendered: tuple[tuple[str, int, bool], list[Strip]] | None = None
        self._width = -1
        self._height = RESERVE_LINES  # as in DEFAULT_CSS
        self.repaints = 0  # redraws of the tail alone, for the tests
        self.relayouts = 0  # height changes (layout passes of the screen), for the tests

    def fits(self, markdown: str) -> bool:
        """Whether ``markdown`` can be drawn in the tail's present height (a repaint, no layout pass)."""
        return len(self.render_markdown(markdown)) <= self._height

    def show(self, markdown: str) -> None:
        """Draw ``markdown``: a repaint of the tail, or a layout pass when its height changes a step."""
        if markdown == self.markdown and self._width == self.size.width:
            return
        self.markdown = markdown
        self._lines = self.render_markdown(markdown)
        height = reserved_height(len(self._lines))
        if height != self._height:
            self._height = self.styles.height = height
            self.relayouts += 1
        else:
            self.refresh()
            self.repaints += 1

    def on_resize(self) -> None:
        if self._width != self.size.width:
            self.show(self.markdown)

    def render_markdown(self, markdown: str) -> list[Strip]:
        """The lines of ``markdown`` at the present width: its top-level blocks one blank line apart (the
        margins Textual's Markdown puts between blocks), each rendered once for as long as it is unchanged."""
        width = self._width = self.size.width
        key = (markdown, width, self.after_blocks)
        if self._rendered is not None and self._rendered[0] == key:
            return self._rendered[1]  # fits() then show() with the same text: parse and render once
        lines = self._render_blocks(markdown, width) if width > 0 and markdown.strip() else []
        self._rendered = (key, lines)
        return lines

    def _render_blocks(self, markdown: str, width: int) -> list[Strip]:
        blocks: dict[tuple[str, int, bool], list[Strip]] = {}
        out: list[Strip] = []
        for index, (token, start, end) in enumerate(top_level_blocks(markdown, self.md)):
            source = markdown[start:end]
            first = index == 0 and not self.after_blocks
            key = (source, width, first)
            strips = self._blocks.get(key)
            if strips is None:
                strips = self._render_block(token, source, width, first)
            blocks[key] = strips
            if index and out:
                out.append(Strip.blank(width, self.rich_style))
            out.extend(strips)
        self._blocks = blocks
        return out

    def _render_block(self, token: Token, source: str, width: int, first: bool) -> list[Strip]:
        base = self.rich_style
        if token.type == "fence":
            # as Textual's MarkdownFence lays it out: margin 1 (only the first block's shows here), padding 1 2,
            # no wrapping; not highlighted until it moves to the Markdown widget
            style = base + self.get_component_rich_style("stream-tail--code", partial=True)
            blank = Strip.blank(width, style)
            lines = [Strip.blank(width, base)] if first else []
            lines.append(blank)
            for line in token.content.expandtabs(4).splitlines():
                segment = Segment(" " * FENCE_PADDING + line, style)
                lines.append(Strip([segment]).adjust_cell_length(width, style))
            lines.append(blank)
            return lines
        console = self.app.console
        options = console.options.update(width=width, height=None)
        if token.type == TOKEN_TYPE:  # as EditBlockView lays it out: margin 1, a header line, padding 1 2
            style = base + self.get_component_rich_style("stream-tail--code", partial=True)
            lines = [Strip.blank(width, base)] if first else []
            header = header_text(token.info, token.content)
            lines.extend(Strip(line, width) for line in console.render_lines(header, options, style=base, pad=True))
            lines.append(Strip.blank(width, style))
            body = edit_block_lines(token.content)
            body.no_wrap = True
            for row in body.split("\n", allow_blank=True):
                segments = [Segment(" " * FENCE_PADDING), *row.render(console, end="")]
                lines.append(Strip(Segment.apply_style(segments, style)).adjust_cell_length(width, style))
            lines.append(Strip.blank(width, style))
            return lines
        return [
            Strip(line, width) for line in console.render_lines(RichMarkdown(source), options, style=base, pad=True)
        ]

    def render_line(self, y: int) -> Strip:
        if y < len(self._lines):
            return self._lines[y]
        return Strip.blank(self.size.width, self.rich_style)
