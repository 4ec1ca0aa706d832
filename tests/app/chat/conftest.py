"""Fixtures of the chat tests: ``store``, a fresh history in a temporary folder (closed after the test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from specchat.app.chat.history.store import ChatStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChatStore]:
    s = ChatStore(tmp_path / "data" / "history.sqlite3")
    yield s
    s.close()
