"""`specchat generate --prompts FILE --parallel N`: the file's requests decoded N at once through the engine's
continuous batching (backend/engine/batch.py), each reply the one it gets alone; printed in the file's order, each
once it has ended."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from specchat.backend.api import GenerationRequest, StepEvent
from specchat.backend.errors import SpecchatError
from specchat.backend.inputs import shown

Printer = Callable[[Iterable[StepEvent], str, int], bool]  # (events, id, sample) -> ended in an error


def run_batched(
    engine, batch: list[tuple[str, int, GenerationRequest]], parallel: int, source: str | None, show: Printer
) -> bool:
    """Run ``batch`` (id, sample, request) ``parallel`` at a time; print each with ``show``; whether any failed.
    A request that fails raises its error naming the prompt, after the replies before it were printed."""
    from specchat.backend.engine.batch import BatchScheduler

    scheduler = BatchScheduler(engine, parallel).start()
    replies: list[queue.SimpleQueue] = []
    cancel = threading.Event()
    try:
        for _, _, request in batch:
            items: queue.SimpleQueue = queue.SimpleQueue()
            replies.append(items)
            scheduler.submit(request, cancel, items.put)
        failed = False
        for (pid, sample, _), items in zip(batch, replies, strict=True):
            events: list[StepEvent] = []
            while (item := items.get()) is not None:
                if isinstance(item, SpecchatError):
                    raise type(item)(f"{source}: prompt {shown(pid)}: {item}") from None
                if isinstance(item, BaseException):
                    raise item
                events.append(item)
            failed = show(events, pid, sample) or failed
        return failed
    finally:
        cancel.set()  # on an error or Ctrl+C: the other replies stop at their next pass
        scheduler.close()
