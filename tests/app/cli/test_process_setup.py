"""What the `specchat` command does to its process before any command runs."""

from __future__ import annotations

import pytest

import specchat.app.cli.models as models_command
import specchat.backend.engine.heap as heap
from specchat.app.cli.main import main


def test_the_malloc_arena_limit_is_set_before_the_command_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """one_arena only binds threads that have not allocated yet, so it comes first, before the command (and the
    threads it starts) runs."""
    calls: list[str] = []
    monkeypatch.setattr(heap, "one_arena", lambda: calls.append("one_arena") or True)
    monkeypatch.setattr(models_command, "run", lambda args: calls.append("models") or 0)
    assert main(["models"]) == 0
    assert calls == ["one_arena", "models"]
