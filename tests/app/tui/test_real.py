"""End to end: the chat app on the real embedded default pair (SmolLM2-135M-Instruct + prompt lookup).

Uses the real wiring (``default_engine_factory``: the engine is imported and loaded in the loading worker
thread) and the user's model cache (the first run converts the packaged GGUF once); history and settings
go to a temporary folder.
"""

from __future__ import annotations

import json

import pytest
from app_harness import notifications, reply_done, send, wait_for

from specchat.app.chat.history.store import ChatStore
from specchat.app.chat.settings import Settings, save_settings
from specchat.app.cli.wiring import default_engine_factory, default_pair_info
from specchat.app.tui.app import SpecchatApp
from specchat.app.tui.widgets.message_view import AssistantMessage
from specchat.backend.models.catalog.config import load_pairs

pytestmark = pytest.mark.slow


async def test_real_default_pair_answers_with_statistics(tmp_path):
    save_settings(Settings(temperature=0.0, max_new_tokens=24), tmp_path / "settings.json")
    app = SpecchatApp(
        load_pairs(),
        engine_factory=default_engine_factory("cpu"),
        pair_info=default_pair_info("cpu"),
        store=ChatStore(tmp_path / "history.sqlite3"),
        settings_path=tmp_path / "settings.json",
        log_path=tmp_path / "specchat.log",
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(
            pilot,
            lambda: app.engine is not None or any("Could not" in n for n in notifications(app)),
            timeout=300,
            what="the default pair to load",
        )
        assert app.engine is not None, notifications(app)
        assert app.current_pair_name == "smollm2-135m"
        await send(pilot, "Write a Python function that adds two numbers.")
        await wait_for(pilot, lambda: not app.chat.generating and app.chat.query(AssistantMessage), timeout=120)
        await reply_done(pilot)
        view = app.chat.query_one(AssistantMessage)
        assert view.text.strip() and view.tokens
        stats = app.store.messages(app.chat.conv.chat_id)[-1].stats
        assert stats["finish_reason"] in ("eos", "length") and stats["new_tokens"] <= 24 and stats["tok_s"] > 0
        assert "tok/s" in view.totals and "prompt-lookup" in view.totals
        assert not [n for n in notifications(app) if "error" in n.lower()]
    assert json.loads((tmp_path / "settings.json").read_text())["last_pair"] == "smollm2-135m"
