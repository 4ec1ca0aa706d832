"""A note in the conversation about an ``/edit``: refused (and why), applied (with ``git diff`` of a file git
tracks), or taken back with ``/undo``. Shown in this session only: the history keeps the messages, not these."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.syntax import Syntax
from rich.text import Text
from textual.widgets import Static

KINDS = {"refused": ("✗ ", "bold yellow"), "applied": ("✓ ", "bold green"), "undone": ("↶ ", "bold cyan")}


class EditNote(Static):
    def __init__(self, kind: str, text: str, diffs: list[tuple[str, str]] | None = None) -> None:
        mark, style = KINDS.get(kind, ("• ", "bold"))
        parts: list[RenderableType] = [Text.assemble((mark, style), text)]
        for title, diff in diffs or []:
            parts.append(Text(title, style="dim"))
            parts.append(Syntax(diff.rstrip("\n"), "diff", theme="ansi_dark", word_wrap=True))
        super().__init__(Group(*parts), classes=f"edit-note {kind}")
        self.kind, self.text = kind, text
