"""Small modal dialogs: confirm (yes/no), ask for a line of text, review a diff before applying it.

Contract: each is a ``ModalScreen`` dismissed with its answer — ``ConfirmScreen`` and ``DiffScreen`` with a
bool (Escape: False), ``TextPromptScreen`` with the entered text or None (Escape or empty).
"""

from __future__ import annotations

from rich.syntax import Syntax
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from specchat.backend.redact import terminal_safe


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [
        Binding("escape", "dismiss(False)", "Cancel"),
        Binding("y", "dismiss(True)", "Yes", show=False),
        Binding("n", "dismiss(False)", "No", show=False),
    ]

    def __init__(self, title: str, body: str, *, yes: str = "Yes", no: str = "Cancel") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.body, self.yes, self.no = title, body, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            yield Static(self.body, classes="dialog-body", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, variant="primary", id="yes")
                yield Button(self.no, id="no")

    def on_mount(self) -> None:
        self.query_one("#yes", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextPromptScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, value: str = "", *, placeholder: str = "", hint: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.value, self.placeholder, self.hint = title, value, placeholder, hint

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            yield Input(self.value, placeholder=self.placeholder, id="text")
            if self.hint:
                yield Static(self.hint, classes="dialog-hint", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("OK", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#text", Input).focus()

    def _answer(self) -> None:
        text = self.query_one("#text", Input).value.strip()
        self.dismiss(text or None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._answer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ok":
            self._answer()
        else:
            self.dismiss(None)


class DiffScreen(ModalScreen[bool]):
    """The diff of an edit, one section per file (its heading names the real file a symlink points to), and
    notes to read before applying; Apply writes the files (the caller does, after dismiss(True))."""

    BINDINGS = [Binding("escape", "dismiss(False)", "Cancel"), Binding("a", "dismiss(True)", "Apply")]

    def __init__(self, sections: list[tuple[str, str]], notes: list[str] | None = None) -> None:
        super().__init__(classes="dialog-screen")
        # file names and contents are the user's files: shown without terminal escapes (the write uses the plan)
        sections = [(terminal_safe(heading), terminal_safe(diff)) for heading, diff in sections]
        self.sections, self.notes = sections, [terminal_safe(note) for note in notes or []]
        self.diff = "".join(diff for _, diff in sections)

    def compose(self) -> ComposeResult:
        lines = self.diff.splitlines()
        added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
        what = self.sections[0][0] if len(self.sections) == 1 else f"{len(self.sections)} files"
        with Vertical(classes="dialog wide"):
            yield Label(f"Apply this edit to {what}?  (+{added} −{removed})", classes="dialog-title", markup=False)
            for note in self.notes:
                yield Static(f"⚠ {note}", classes="dialog-note", markup=False)
            with VerticalScroll(id="diff-scroll"):
                for heading, diff in self.sections:
                    if len(self.sections) > 1:
                        yield Static(heading, classes="diff-heading", markup=False)
                    yield Static(Syntax(diff, "diff", theme="ansi_dark", word_wrap=False), classes="diff")
            yield Static(
                "A backup of each file is kept next to it; /undo puts them back. a: apply · Esc: cancel",
                classes="dialog-hint",
            )
            with Horizontal(classes="dialog-buttons"):
                yield Button("Apply", variant="success", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#diff-scroll").focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "apply")
