"""`specchat generate`'s replies on stdout (:func:`show_reply`: the text, or one JSON line, and the totals on
stderr), and ``--parallel N`` (:func:`run_batched`): the requests decoded N at once through the engine's
continuous batching (backend/engine/batch.py), each reply the one it gets alone, printed in the file's order,
each once it has ended."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from specchat.backend.api import GenerationRequest, RequestStats, StepEvent
from specchat.backend.errors import SpecchatError
from specchat.backend.inputs import shown
from specchat.backend.redact import terminal_safe

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


def show_reply(events: Iterable[StepEvent], pid: str, sample: int, as_json: bool, out: Any) -> bool:
    """Print one reply from its events; returns whether it ended in an error."""
    token_ids: list[int] = []
    text: list[str] = []
    last = None
    for event in events:
        token_ids.extend(event.token_ids)
        text.append(event.text)
        if event.message:
            print(f"specchat: {terminal_safe(event.message)}", file=sys.stderr)
        if not as_json and event.text:
            out.write(event.text)
        last = event
    assert last is not None  # generate() always ends with the event that carries finish_reason
    stats = last.stats or RequestStats()
    if as_json:
        record = {
            "id": pid,
            "sample": sample,
            "seed": stats.seed,
            "text": "".join(text),
            "token_ids": token_ids,
            "prompt_tokens": stats.prompt_tokens,
            "finish_reason": last.finish_reason,
            "drafter": stats.drafter,
            "stats": stats.to_json_stats(),
        }
        out.json_line(record)
    else:
        out.write("\n")
        rate = stats.acceptance_rate
        print(
            f"[{last.finish_reason}] {stats.new_tokens if stats.tokens_counted else '—'} tokens, "
            f"{f'{stats.tok_s:.1f}' if stats.tok_s is not None else '—'} tok/s, "
            f"drafter {stats.drafter}, acceptance "
            f"{'n/a' if rate is None else f'{rate:.0%}'}, "
            f"τ {stats.mean_accepted_length or 0:.2f} per speculating step, "
            f"seed {stats.seed}"
            + (
                f", prediction tokens accepted {stats.accepted_prediction_tokens}, rejected "
                f"{stats.rejected_prediction_tokens}"
                if stats.accepted_prediction_tokens is not None
                else ""
            ),
            file=sys.stderr,
        )
    return last.finish_reason == "error"
