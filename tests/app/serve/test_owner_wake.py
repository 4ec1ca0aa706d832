"""The engine owner wakes the HTTP side's event loop once per event for a stream, and only when the reply has
ended for a non-streaming one (which is read whole): a wake per step would only take time from the engine."""

from __future__ import annotations

from specchat.app.serve.owner import END, EngineOwner
from specchat.backend.api import GenerationRequest


class _Engine:
    """Yields ``count`` items per request, then raises ``error`` when one is given."""

    def __init__(self, count: int, error: Exception | None = None) -> None:
        self.count, self.error = count, error

    def generate(self, request, cancel=None):
        yield from range(self.count)
        if self.error is not None:
            raise self.error


def _run(engine: _Engine, wake_each: bool) -> tuple[int, list[object]]:
    owner = EngineOwner(engine, queue_size=2)  # type: ignore[arg-type]
    calls: list[int] = []

    def notify() -> None:
        calls.append(1)

    job = owner.submit(GenerationRequest(messages=[{"role": "user", "content": "hi"}]), notify, wake_each=wake_each)
    items: list[object] = []
    while not items or items[-1] is not END:
        items.append(job.events.get(timeout=10))
    owner.close()
    return len(calls), items


def test_a_stream_wakes_the_loop_after_every_item() -> None:
    wakes, items = _run(_Engine(5), wake_each=True)
    assert items == [0, 1, 2, 3, 4, END] and wakes == 6


def test_a_whole_reply_wakes_the_loop_only_at_its_end_with_every_item_queued() -> None:
    wakes, items = _run(_Engine(5), wake_each=False)
    assert items == [0, 1, 2, 3, 4, END] and wakes == 1


def test_a_whole_reply_that_fails_wakes_the_loop_for_the_error_too() -> None:
    error = RuntimeError("boom")
    wakes, items = _run(_Engine(3, error), wake_each=False)
    assert items == [0, 1, 2, error, END] and wakes == 2
