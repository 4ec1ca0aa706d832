"""`specchat` without a subcommand (app/cli/chat.py): the pairs, the history, the real wiring and the log file
reach the app; a history that cannot be opened becomes a notice, not a failure. The app itself is replaced by a
recorder (the UI is tested on the fake engine in tests/app/tui)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from specchat.app.chat.history.records import StoreError
from specchat.app.chat.history.store import ChatStore
from specchat.app.cli import chat
from specchat.app.cli.main import main


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


class RecordingApp:
    """Stands in for SpecchatApp: keeps what it was built with and 'runs' at once."""

    built: list[RecordingApp] = []

    def __init__(self, pairs: Any, **kwargs: Any) -> None:
        self.pairs, self.kwargs, self.loading_pair = pairs, kwargs, None
        self.root_handlers: list[logging.Handler] = []
        RecordingApp.built.append(self)

    def run(self) -> int:
        self.root_handlers = logging.getLogger().handlers[:]
        self.store_open = self.kwargs["store"] is not None and self.kwargs["store"]._conn is not None
        return 0


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[RecordingApp]:
    RecordingApp.built = []
    monkeypatch.setattr(chat, "SpecchatApp", RecordingApp)
    return RecordingApp.built


def test_no_subcommand_builds_the_app_with_the_pairs_history_and_wiring(recorded, isolated_dirs: Path) -> None:
    assert main(["--pair", "smollm2-135m", "--device", "cpu"]) == 0
    (app,) = recorded
    assert "smollm2-135m" in app.pairs
    kwargs = app.kwargs
    assert kwargs["initial_pair"] == "smollm2-135m" and kwargs["startup_notices"] == []
    assert isinstance(kwargs["store"], ChatStore) and app.store_open
    assert kwargs["store"]._conn is None  # closed after the app ended
    assert kwargs["store"].path == isolated_dirs / "data" / "history.sqlite3"
    assert kwargs["log_path"] == isolated_dirs / "data" / "logs" / "specchat.log"
    assert any(getattr(h, "baseFilename", None) == str(kwargs["log_path"]) for h in app.root_handlers)
    assert callable(kwargs["engine_factory"]) and callable(kwargs["pair_info"])


def test_a_history_that_cannot_be_opened_is_a_notice(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> ChatStore:
        raise StoreError("cannot create the history folder /nope: Permission denied.")

    monkeypatch.setattr(chat, "ChatStore", unavailable)
    assert main([]) == 0
    (app,) = recorded
    assert app.kwargs["store"] is None
    assert app.kwargs["startup_notices"] == [
        "History is disabled for this session: cannot create the history folder /nope: Permission denied."
    ]


def test_a_read_only_history_is_opened_and_said_once_at_start(recorded, isolated_dirs: Path) -> None:
    """Issue 20 item 4: a 0444 history is read, never chmodded; the start notice is the only word about it."""
    import os

    db = isolated_dirs / "data" / "history.sqlite3"
    with ChatStore(db) as store:
        store.create_chat("kept", "p")
    os.chmod(db, 0o444)
    assert main([]) == 0
    (app,) = recorded
    assert app.store_open and app.kwargs["store"].read_only
    (notice,) = app.kwargs["startup_notices"]
    assert "read-only" in notice and "(mode 0444)" in notice and "chmod u+w" in notice
    assert db.stat().st_mode & 0o777 == 0o444


def test_an_unknown_pair_fails_like_generate_before_the_ui_starts(recorded, capsys: pytest.CaptureFixture) -> None:
    """Issue 19: `specchat --pair nope` opened the default pair (the app fell back before it could refuse)."""
    assert main(["--pair", "nope"]) == 2
    ui_error = capsys.readouterr().err
    assert not recorded  # no UI was built
    assert main(["generate", "--pair", "nope", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == ui_error
    assert ui_error.startswith("specchat: error: unknown pair 'nope': known pairs are smollm2-135m")


def test_the_app_refuses_an_unknown_pair_even_when_a_last_pair_is_known(tmp_path: Path) -> None:
    from specchat.app.chat.settings import Settings, save_settings
    from specchat.app.tui.app import SpecchatApp
    from specchat.backend.errors import SpecchatError
    from specchat.backend.models.catalog.config import load_pairs

    save_settings(Settings(last_pair="smollm2-135m"), tmp_path / "settings.json")
    with pytest.raises(SpecchatError, match="--pair nope: no such pair"):
        SpecchatApp(
            load_pairs(None),
            engine_factory=lambda *a: None,
            settings_path=tmp_path / "settings.json",
            initial_pair="nope",
        )
