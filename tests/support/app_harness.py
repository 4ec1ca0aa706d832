"""Helpers for the UI tests: build the app on the fake engine in a temporary home, wait for conditions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fake_engine import FakeEngineFactory, fake_pair_info, fake_pairs

from specchat.app.chat.history.store import ChatStore
from specchat.app.tui.app import SpecchatApp


def make_app(
    tmp_path: Path,
    *,
    factory: FakeEngineFactory | None = None,
    store: Any = "new",
    pairs: dict | None = None,
    **kwargs: Any,
) -> SpecchatApp:
    if store == "new":
        store = ChatStore(tmp_path / "history.sqlite3")
    return SpecchatApp(
        pairs if pairs is not None else fake_pairs(),
        engine_factory=factory or FakeEngineFactory(),
        pair_info=kwargs.pop("pair_info", fake_pair_info),
        store=store,
        settings_path=tmp_path / "settings.json",
        log_path=tmp_path / "specchat.log",
        **kwargs,
    )


async def wait_for(pilot: Any, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Let the app run until ``predicate()`` holds (fails the test after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await pilot.pause(0.02)
    await pilot.pause()  # let a screen that just appeared finish its layout before the test clicks on it


async def ready(pilot: Any) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None, what="the engine to load")


async def send(pilot: Any, text: str) -> None:
    prompt = pilot.app.chat.query_one("#prompt")
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")


async def reply_done(pilot: Any) -> None:
    chat = pilot.app.chat
    await wait_for(pilot, lambda: not chat.generating, what="the reply to finish")
    await pilot.pause()


def notifications(app: Any) -> list[str]:
    return [f"{n.title or ''}: {n.message}" for n in app._notifications]


async def settle() -> None:
    await asyncio.sleep(0)


def screen_text(app: Any) -> str:
    """What the terminal shows now, as text: one line per row (what a user reads, clipped as they see it)."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(segment.text for segment in strip) for strip in strips)
