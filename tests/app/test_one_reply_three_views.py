"""One reply, three views: the chat UI, `specchat generate --json` and the history show the same statistics.

A real engine (a tiny random-weight model, prompt lookup on a repetitive prompt, so drafts are accepted and
rejected) produces one reply; a replaying engine hands exactly those events to the UI and to the CLI's JSON
writer, and the UI saves the reply to a real history store. Every number the three show comes from the
engine's one RequestStats (backend/speculative/stats.py); this test fails if any view counts on its own.
"""

from __future__ import annotations

import copy
import io
import json
import threading
from collections.abc import Iterator
from contextlib import redirect_stdout

from app_harness import make_app, ready, reply_done, send
from engine_fixtures import tiny_engine
from fake_engine import fake_pairs
from tiny_models import random_ids

from specchat.app.chat.history.store import ChatStore
from specchat.app.cli.generate import _one, _Stdout
from specchat.app.tui.widgets.details_panel import DetailsPanel
from specchat.app.tui.widgets.stats_bar import StatsLine, reply_totals
from specchat.backend.api import JSON_STATS_FIELDS, GenerationRequest, RequestStats, SamplingParams, StepEvent


class ReplayEngine:
    """An EngineAPI that replays one recorded reply (fresh copies each time: consumers may not share events)."""

    def __init__(self, events: list[StepEvent]) -> None:
        self.events = events

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        for event in self.events:
            yield copy.deepcopy(event)

    def forget(self, conversation: str) -> None:
        pass

    def close(self) -> None:
        pass


def recorded_reply() -> list[StepEvent]:
    motif = random_ids(6, seed=3)
    engine = tiny_engine("llama", drafter="prompt-lookup", gamma=3)
    request = GenerationRequest(prompt_ids=motif * 5, sampling=SamplingParams(temperature=0.0, max_new_tokens=40))
    events = list(engine.generate(request))
    final = events[-1].stats
    assert final is not None and final.drafted > final.accepted > 0  # accepted and rejected drafts both
    return events


async def test_ui_json_and_history_show_the_same_numbers(tmp_path) -> None:
    events = recorded_reply()
    final: RequestStats = events[-1].stats

    out = io.StringIO()
    with redirect_stdout(out):
        _one(ReplayEngine(events), GenerationRequest(prompt_ids=[5]), "p", 0, True, _Stdout())
    as_json = json.loads(out.getvalue())

    store = ChatStore(tmp_path / "history.sqlite3")

    def factory(pair, progress, confirm_download):
        return ReplayEngine(events)

    app = make_app(tmp_path, factory=factory, store=store)
    async with app.run_test(size=(140, 45)) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        await reply_done(pilot)
        totals = app.chat.conversation.last_reply().totals
        line = app.chat.stats_bar.query_one("#stats-text", StatsLine).text.plain
        await pilot.press("ctrl+g")
        await pilot.pause()
        details = str(app.chat.query_one(DetailsPanel).render())
        chat_id = app.chat.conv.chat_id
    row = store.messages(chat_id)[-1].stats
    store.close()

    # --json: exactly the engine's totals.
    assert as_json["stats"] == final.to_json_stats()
    assert list(as_json["stats"]) == list(JSON_STATS_FIELDS)
    # History: the same object, plus how the reply ended and the pair that wrote it.
    assert RequestStats.from_dict(row) == final
    assert {k: row[k] for k in JSON_STATS_FIELDS} == as_json["stats"]
    assert row["finish_reason"] == events[-1].finish_reason and row["pair"] == next(iter(fake_pairs()))
    # UI: the reply's totals line, the stats line and the details panel show the same numbers.
    assert totals == reply_totals(RequestStats.from_dict(row), row["finish_reason"])
    assert f"{as_json['stats']['new_tokens']} tokens" in totals
    assert f"acc {round(final.acceptance_rate * 100)}%" in line and f"τ {final.mean_accepted_length:.2f}" in line
    for label, value in (
        ("tokens", final.new_tokens),
        ("drafted", final.drafted),
        ("accepted", final.accepted),
        ("steps", final.steps),
    ):
        assert any(part.split() == [label, str(value)] for part in details.splitlines()), (label, details)
