"""The settings modal: sampling, max new tokens, drafter, γ, earlier replies for drafting, system prompt.

Contract: dismissed with a validated :class:`Settings` (Save) or None (Cancel / Escape). A bad value keeps
the dialog open, marks the field and says what is accepted; nothing is saved until every field is valid.
Empty sampling fields mean "the pair's default", and each says what that is for the pair in use (its
models.yaml value, else "the model's default": the model's generation_config, which the UI does not read).
The drafter is chosen for the pair in use (the settings keep one per pair): the list names every drafter the
engine knows with what it needs; one the pair cannot use is shown disabled with why (no pair loaded: all but
the pair's own are disabled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, TypeVar, cast

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, RadioButton, RadioSet, Select, Static, TextArea

from specchat.app.chat.settings import (
    DRAFTER_CHOICES,
    DrafterOption,
    Settings,
    SettingsError,
    drafter_options,
    validate_settings,
)
from specchat.backend.limits import CHAT_MAX_NEW_TOKENS_LIMIT, MAX_GAMMA

if TYPE_CHECKING:
    from specchat.app.chat.settings import DrafterChoice
    from specchat.backend.models.catalog.config import PairConfig

T = TypeVar("T", int, float)  # what a number field parses to


def drafter_text(option: DrafterOption) -> Text:
    """One line of the drafter list: its name, then what it needs, or why this pair cannot use it."""
    text = Text(option.label, style="bold")
    if option.unavailable is not None:
        text.append(f" — {option.unavailable}", style="dim")
    elif option.needs:
        text.append(f" — {option.needs}")
    return text


GAMMA_MODES = {"pair": "Pair default", "auto": "Auto (adaptive)", "fixed": "Fixed"}


def _text(value: object) -> str:
    return "" if value is None else str(value)


class SettingsScreen(ModalScreen[Settings | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: Settings, pair: PairConfig | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.settings, self.pair = settings, pair

    @property
    def pair_name(self) -> str | None:
        return self.pair.name if self.pair is not None else None

    def drafter_title(self) -> str:
        if self.pair is None:
            return "Drafter (load a pair first: the choice is kept per pair)"
        return f"Drafter for {self.pair.name} (kept for this pair only)"

    def chosen_drafter(self) -> DrafterChoice:
        pressed = self.query_one("#drafter", RadioSet).pressed_button
        name = (pressed.id or "").removeprefix("drafter-") if pressed is not None else "pair"
        return cast("DrafterChoice", name if name in DRAFTER_CHOICES else "pair")

    def pair_default(self, name: str) -> str:
        """What an empty field means for the pair in use, e.g. "pair default: 0.2"."""
        if self.pair is None:
            return "pair default"
        value = (getattr(self.pair, "sampling", None) or {}).get(name)
        return f"{self.pair.name} default: {value}" if value is not None else "the model's default"

    def compose(self) -> ComposeResult:
        s = self.settings
        gamma_mode = "pair" if s.gamma is None else "auto" if s.gamma == "auto" else "fixed"
        modes = dict(GAMMA_MODES)
        if self.pair is not None:
            modes["pair"] = f"Pair default ({self.pair.gamma})"
        with Vertical(classes="dialog wide", id="settings"):
            yield Label("Settings  (empty = the pair's default · Ctrl+S saves · Esc cancels)", classes="dialog-title")
            with VerticalScroll(id="settings-scroll"):
                with Grid(id="settings-grid"):
                    yield Label("Temperature (0 = greedy)")
                    yield Input(
                        _text(s.temperature),
                        placeholder=self.pair_default("temperature"),
                        id="temperature",
                        compact=True,
                    )
                    yield Label("Top-p (0..1]")
                    yield Input(_text(s.top_p), placeholder=self.pair_default("top_p"), id="top_p", compact=True)
                    yield Label("Top-k (0 = off)")
                    yield Input(_text(s.top_k), placeholder=self.pair_default("top_k"), id="top_k", compact=True)
                    yield Label("Max new tokens")
                    yield Input(_text(s.max_new_tokens), id="max_new_tokens", compact=True)
                    yield Label("γ (draft tokens per step)")
                    with Horizontal(id="gamma-row"):
                        yield Select(
                            [(label, key) for key, label in modes.items()],
                            value=gamma_mode,
                            allow_blank=False,
                            id="gamma_mode",
                            compact=True,
                        )
                        yield Input(_text(s.gamma) if gamma_mode == "fixed" else "4", id="gamma", compact=True)
                    yield Label("Earlier replies")
                    yield Select(
                        [("Suffix drafter matches them (next load)", "on"), ("Not used for drafting", "off")],
                        value="on" if s.draft_from_history else "off",
                        allow_blank=False,
                        id="draft_from_history",
                        compact=True,
                    )
                yield Label(self.drafter_title(), id="drafter-title", markup=False)
                with RadioSet(id="drafter"):
                    for option in drafter_options(self.pair):
                        yield RadioButton(
                            drafter_text(option),
                            value=option.name == s.drafter_for(self.pair_name),
                            id=f"drafter-{option.name}",
                            disabled=option.unavailable is not None or (self.pair is None and option.name != "pair"),
                        )
                yield Label("System prompt")
                yield TextArea(s.system_prompt, id="system_prompt", soft_wrap=True)
            yield Static("", id="settings-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self._sync_gamma()
        self.query_one("#temperature", Input).focus()

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "gamma_mode":
            self._sync_gamma()

    def _sync_gamma(self) -> None:
        self.query_one("#gamma", Input).display = self.query_one("#gamma_mode", Select).value == "fixed"

    def _parse(self, field: str, kind: Callable[[str], T]) -> T | None:
        raw = self.query_one(f"#{field}", Input).value.strip()
        if not raw:
            return None
        try:
            return kind(raw)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise SettingsError(f"{field.replace('_', ' ')}: expected {what}, got {raw!r}") from None

    def _collect(self) -> Settings:
        gamma_mode = self.query_one("#gamma_mode", Select).value
        gamma: int | Literal["auto"] | None = (
            None if gamma_mode == "pair" else "auto" if gamma_mode == "auto" else self._parse("gamma", int)
        )
        if gamma_mode == "fixed" and gamma is None:
            raise SettingsError(f"gamma: a fixed γ needs a number (1 .. {MAX_GAMMA})")
        max_new = self._parse("max_new_tokens", int)
        if max_new is None:
            raise SettingsError(f"max new tokens: a number is required (1 .. {CHAT_MAX_NEW_TOKENS_LIMIT})")
        settings = self.settings
        if self.pair_name is not None:
            settings = settings.with_drafter(self.pair_name, self.chosen_drafter())
        return validate_settings(
            replace(
                settings,
                temperature=self._parse("temperature", float),
                top_p=self._parse("top_p", float),
                top_k=self._parse("top_k", int),
                max_new_tokens=max_new,
                gamma=gamma,
                system_prompt=self.query_one("#system_prompt", TextArea).text,
                draft_from_history=self.query_one("#draft_from_history", Select).value == "on",
            )
        )

    def action_save(self) -> None:
        for widget in self.query(Input):
            widget.remove_class("-invalid")
        try:
            settings = self._collect()
        except SettingsError as error:
            message = str(error)
            self.query_one("#settings-error", Static).update(f"⚠ {message}")
            field = message.removeprefix("setting ").split(":")[0].strip("' ").replace(" ", "_")
            for widget in self.query(Input):
                if widget.id == field:
                    widget.add_class("-invalid")
                    widget.focus()
            return
        self.dismiss(settings)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)
