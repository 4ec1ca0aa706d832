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


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("escape", "dismiss(False)", "Cancel"), Binding("y", "dismiss(True)", "Yes", show=False),
                Binding("n", "dismiss(False)", "No", show=False)]

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
    """Shows the unified diff of an edit; Apply writes the file (the caller does, after dismiss(True))."""

    BINDINGS = [Binding("escape", "dismiss(False)", "Cancel"), Binding("a", "dismiss(True)", "Apply")]

    def __init__(self, path: str, diff: str) -> None:
        super().__init__(classes="dialog-screen")
        self.path, self.diff = path, diff

    def compose(self) -> ComposeResult:
        added = sum(1 for line in self.diff.splitlines() if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in self.diff.splitlines() if line.startswith("-") and not line.startswith("---"))
        with Vertical(classes="dialog wide"):
            yield Label(f"Apply this edit to {self.path}?  (+{added} −{removed})", classes="dialog-title",
                        markup=False)
            with VerticalScroll(id="diff-scroll"):
                yield Static(Syntax(self.diff, "diff", theme="ansi_dark", word_wrap=False), id="diff")
            yield Static("A backup of the current file is kept next to it. a: apply · Esc: cancel",
                         classes="dialog-hint")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Apply", variant="success", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#diff-scroll").focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "apply")
