"""The Textual chat app: holds the engine handle, loads pairs in the background, pushes the screens.

Contract:
- ``SpecchatApp(pairs, engine_factory=..., pair_info=..., store=..., settings_path=...)``: ``pairs`` maps
  names to pair configs; ``engine_factory(pair, progress, confirm_download) -> EngineAPI`` (seams.py) runs in a
  daemon thread (so quitting never waits for a load); ``progress(message, fraction)`` is throttled to ~10
  messages a second. The engine is closed (in that thread) before the next pair loads, after the chat screen
  has stopped any reply. A failed switch reloads the previous pair; the conversation is kept.
- ``confirm_download(total_bytes) -> bool`` asks the user in a dialog (the loader thread waits for the answer)
  unless the picker already asked. ``store`` None: history is disabled for the session.
- Settings (and the theme) are saved to the config dir on change; the last loaded pair is remembered.
- Built by the CLI layer (app/cli/chat.py), which passes in everything that reaches the backend beyond its
  API; importing this module does not import torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from textual import events
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.theme import Theme

from specchat.app.chat.settings import Settings, SettingsError, load_settings, save_settings
from specchat.app.tui.bridge import ThrottledProgress
from specchat.app.tui.messages import EngineLoaded, EngineLoadFailed, EngineLoadProgress
from specchat.app.tui.screens.chat import ChatScreen
from specchat.app.tui.screens.dialogs import ConfirmScreen
from specchat.app.tui.screens.help import HelpScreen
from specchat.app.tui.screens.history import HistoryResult, HistoryScreen
from specchat.app.tui.screens.picker import PairPickerScreen, human_bytes
from specchat.app.tui.screens.settings_screen import SettingsScreen
from specchat.app.tui.seams import EngineFactory, PairInfo
from specchat.app.tui.widgets.message_view import warm_highlighting
from specchat.backend.errors import InsufficientMemoryError, SpecchatError
from specchat.backend.limits import DEFAULT_PAIR
from specchat.backend.redact import terminal_safe

if TYPE_CHECKING:
    from specchat.app.chat.history.store import ChatStore
    from specchat.backend.api import EngineAPI
    from specchat.backend.models.catalog.config import PairConfig

log = logging.getLogger(__name__)
# The longest a notification stays, by severity (seconds): an information toast is read at a glance, an error
# may need reading twice; a click dismisses any of them sooner.
NOTIFY_MAX_S: dict[str, float] = {"information": 5.0, "warning": 8.0, "error": 12.0}


class SpecchatApp(App[int]):
    CSS_PATH = "styles.tcss"
    TITLE = "specchat"
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("f2", "pick_pair", "Pair"),
        Binding("f3", "settings", "Settings"),
        Binding("f4", "history", "History"),
    ]

    def __init__(
        self,
        pairs: Mapping[str, PairConfig],
        *,
        engine_factory: EngineFactory,
        pair_info: PairInfo | None = None,
        store: ChatStore | None = None,
        settings_path: Path | None = None,
        initial_pair: str | None = None,
        log_path: Path | None = None,
        startup_notices: Iterable[str] = (),
    ) -> None:
        super().__init__()
        self.pairs = dict(pairs)
        self.engine_factory, self.pair_info, self.store = engine_factory, pair_info, store
        self.settings_path = settings_path
        self.settings, warning = load_settings(settings_path)
        self._settings_unsaved = False  # a save failed and the user was told (told again only after a success)
        self.log_path = log_path
        self.notices = [*startup_notices, *([warning] if warning else [])]
        self.engine: EngineAPI | None = None
        self.current_pair_name: str | None = None
        self.loading_pair: str | None = None
        self._previous_pair: str | None = None
        self._download_ok: set[str] = set()  # pairs whose download the user accepted in the picker
        self._load_started = 0.0
        self.initial_pair = self._initial_pair(initial_pair)
        self.chat = ChatScreen(self)

    @property
    def current_pair(self) -> PairConfig | None:
        """The loaded pair's configuration (ChatHost); None when none is loaded."""
        return self.pairs.get(self.current_pair_name or "")

    def _initial_pair(self, requested: str | None) -> str | None:
        if requested and requested not in self.pairs:  # never another pair in its place
            known = ", ".join(self.pairs) or "none"
            raise SpecchatError(f"--pair {requested}: no such pair (known: {known}). See `specchat models`.")
        for name in (requested, self.settings.last_pair, DEFAULT_PAIR):
            if name and name in self.pairs:
                return name
        return next(iter(self.pairs), None)

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def on_mount(self) -> None:
        if self.settings.theme and self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self.begin_capture_print(self)  # stray prints (any thread) go to the log file, never over the screen
        await self.push_screen(self.chat)
        for notice in self.notices:
            self.notify(notice, severity="warning", timeout=10)
        if self.initial_pair is None:
            self.chat.stats_bar.show_unloaded("No model pairs configured: check models.yaml (`specchat models`).")
        else:
            self.load_pair(self.initial_pair)

    def on_print(self, event: events.Print) -> None:
        text = event.text.strip()
        if text:
            logging.getLogger("specchat.stray_output").info("%s", text)

    async def action_quit(self) -> None:
        await self.chat.stop_generation()
        self.exit(0)

    def on_unmount(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 - exiting anyway; the traceback goes to the log
                log.exception("closing the engine failed")
            self.engine = None

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,  # noqa: ARG002 - Textual's signature; never honoured (see below)
    ) -> None:
        """Every notification of the app, its screens and widgets (``Widget.notify`` calls this one, passing
        ``markup=True`` by default): file names, paths, titles and error text are user data, so markup is always
        off (``/file [b]x[/b].txt`` shows as typed). Toasts stand at the top right, clear of the input and the
        statistics (styles.tcss), and last at most :data:`NOTIFY_MAX_S` for their severity."""
        limit = NOTIFY_MAX_S.get(severity, NOTIFY_MAX_S["error"])
        shown_for = limit if timeout is None else min(timeout, limit)
        # Terminal escapes an error may quote (a models.yaml value, a server's text) never reach the terminal.
        message, title = terminal_safe(message), terminal_safe(title)
        super().notify(message, title=title, severity=severity, timeout=shown_for, markup=False)

    def _theme_changed(self, theme: Theme) -> None:
        if self.settings.theme != theme.name:
            self.update_settings(replace(self.settings, theme=theme.name))

    def update_settings(self, settings: Settings) -> None:
        """Use ``settings`` now and save them; a failed save (read-only, disk full) is said once, not per change."""
        self.settings = settings
        try:
            save_settings(settings, self.settings_path)
        except SettingsError as error:
            if not self._settings_unsaved:
                self.notify(str(error), title="Settings not saved", severity="error", timeout=10)
            self._settings_unsaved = True
        else:
            self._settings_unsaved = False

    # -- loading pairs -----------------------------------------------------------------------------------------
    def load_pair(self, name: str) -> None:
        """Start loading ``name`` in the background (the old engine is closed first, in the worker)."""
        old, self.engine = self.engine, None
        self._previous_pair = self.current_pair_name
        self.loading_pair, self._load_started = name, time.monotonic()
        self.chat.stats_bar.start_loading(name)
        # A daemon thread, not a Textual thread worker: those run in asyncio's default executor, which
        # App.run() joins on exit, so quitting during a multi-GB download would hang until it finished.
        threading.Thread(
            target=self._load, args=(self.pairs[name], old), name=f"specchat-load-{name}", daemon=True
        ).start()

    def _load(self, pair: PairConfig, old_engine: EngineAPI | None) -> None:
        if old_engine is not None:
            try:
                old_engine.close()
            except Exception:  # noqa: BLE001 - the new load goes on; the traceback goes to the log
                log.exception("closing the previous engine failed")
        progress = ThrottledProgress(
            lambda text, fraction: self.post_message(EngineLoadProgress(pair.name, text, fraction))
        )
        try:
            engine = self.engine_factory(pair, progress, lambda total: self._confirm_download(pair.name, total))
        except BaseException as error:  # noqa: BLE001 - reported to the UI thread, which decides
            self.post_message(EngineLoadFailed(pair.name, error))
            return
        warm_highlighting()  # here, not in the first reply: it would compete with that reply's decoding
        self.post_message(EngineLoaded(pair.name, engine, time.monotonic() - self._load_started))

    def _confirm_download(self, pair_name: str, total_bytes: int) -> bool:
        """Called in the loader thread: ask in a dialog (unless the picker already did) and wait for the answer."""
        if pair_name in self._download_ok:
            return True
        answered, result = threading.Event(), [False]

        def done(ok: bool | None) -> None:
            result[0] = bool(ok)
            answered.set()

        self.call_from_thread(
            self.push_screen,
            ConfirmScreen(
                "Download needed",
                f"{pair_name} needs a download of {human_bytes(total_bytes)} from the Hugging Face "
                "hub. Download it now?",
                yes="Download",
            ),
            done,
        )
        answered.wait()
        return result[0]

    def on_engine_load_progress(self, message: EngineLoadProgress) -> None:
        if message.pair_name == self.loading_pair:
            self.chat.stats_bar.show_loading(message.pair_name, message.text, message.fraction)

    async def on_engine_loaded(self, message: EngineLoaded) -> None:
        self.engine, self.current_pair_name, self.loading_pair = message.engine, message.pair_name, None
        path = getattr(message.engine, "start_line", None)  # how it runs (backend: Engine.start_line)
        note = f"ready in {message.seconds:.1f} s" + (f" · {path}" if path else "")
        self.chat.stats_bar.show_ready(message.pair_name, note)
        self.chat.stats_bar.set_path(path)
        fallback = getattr(message.engine, "fallback_reason", None)
        if fallback and "being built in the background" in fallback:  # replies now; the kernels take over later
            self.notify(f"{message.pair_name} runs on {path}", title="Building the CPU kernels", timeout=10)
        elif fallback:  # the CPU native model does not run it: the same line generate and serve print
            self.notify(f"{message.pair_name} runs on {path}", title="Slower path", severity="warning", timeout=10)
        self.chat.update_title()
        if self.settings.last_pair != message.pair_name:
            self.update_settings(replace(self.settings, last_pair=message.pair_name))
        await self.chat.engine_ready()

    def on_engine_load_failed(self, message: EngineLoadFailed) -> None:
        error, name = message.error, message.pair_name
        self.loading_pair = None
        if isinstance(error, InsufficientMemoryError):
            text, title = f"{error} Choose a smaller pair with F2.", f"{name} does not fit"
        elif isinstance(error, SpecchatError):
            text, title = f"{error} Choose another pair with F2.", f"Could not load {name}"
        else:
            log.error("loading %s failed", name, exc_info=error)
            text = f"{type(error).__name__}: {error}. The traceback is in {self.log_path}. Choose another pair with F2."
            title = f"Could not load {name}"
        self.notify(text, title=title, severity="error", timeout=15)
        previous, self._previous_pair = self._previous_pair, None
        if previous and previous != name:
            self.notify(f"Going back to {previous}.", timeout=5)
            self.current_pair_name = None
            self.load_pair(previous)
            return
        self.current_pair_name = None
        self.chat.stats_bar.show_unloaded(f"no model loaded ({name} failed) · F2 to choose a pair")
        self.chat.update_title()
        self.chat.engine_unavailable()

    async def switch_pair(self, name: str) -> None:
        if name == self.current_pair_name and self.engine is not None:
            return
        if self.loading_pair is not None:
            self.notify(f"{self.loading_pair} is still loading; choose again when it is ready.", timeout=5)
            return
        await self.chat.stop_generation()
        self.load_pair(name)

    # -- actions ----------------------------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_pick_pair(self) -> None:
        picker = PairPickerScreen(self.pairs, self.current_pair_name, self.pair_info)

        async def chosen(name: str | None) -> None:
            if name is not None:
                if picker.download_confirmed:
                    self._download_ok.add(name)
                await self.switch_pair(name)

        self.push_screen(picker, chosen)

    def action_settings(self) -> None:
        def chosen(settings: Settings | None) -> None:
            if settings is not None:
                self.update_settings(settings)
                self.notify("Settings saved; they apply from the next reply.", timeout=3)

        pair = self.pairs.get(self.current_pair_name or self.loading_pair or "")
        self.push_screen(SettingsScreen(self.settings, pair), chosen)

    def action_history(self) -> None:
        if self.store is None:
            self.notify(
                "History is disabled in this session (it could not be opened at start-up).",
                severity="warning",
                timeout=6,
            )
            return

        async def chosen(result: HistoryResult | None) -> None:
            if result is None:
                return
            if self.chat.conv.chat_id in result.deleted and result.open_chat is None:
                await self.chat.new_chat()
            if result.open_chat is not None:
                await self.chat.open_chat(result.open_chat)

        self.push_screen(HistoryScreen(self.store, self.chat.conv.chat_id), chosen)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat
        yield SystemCommand("New chat", "Start a new conversation (Ctrl+N)", chat.action_new_chat)
        yield SystemCommand("Chat history", "Open, rename, delete or export past chats (F4)", self.action_history)
        yield SystemCommand("Model pair", "Choose the target/drafter pair (F2)", self.action_pick_pair)
        yield SystemCommand("Settings", "Sampling, drafter, γ, system prompt (F3)", self.action_settings)
        yield SystemCommand("Regenerate", "Regenerate the last reply (Ctrl+R)", chat.action_regenerate)
        yield SystemCommand("Stop", "Stop the reply, keeping what was written (Esc)", chat.action_stop)
        yield SystemCommand("Accepted-token view", "Colour replies by token source (Ctrl+T)", chat.action_toggle_tokens)
        yield SystemCommand("Details panel", "Per-position acceptance and speedup (Ctrl+G)", chat.action_toggle_details)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard (Ctrl+O)", chat.action_copy_reply)
        yield SystemCommand("Copy last code block", "Copy the last reply's code block (Ctrl+B)", chat.action_copy_code)
        yield SystemCommand("Export chat", "Export this chat to a Markdown file", chat.action_export_chat)
        yield SystemCommand("Review edit", "Show the last /edit reply as a diff again", chat.action_review_edit)
        yield SystemCommand("Help", "Keys, commands and what the statistics mean (F1)", self.action_help)
