"""The one owner of the engine behind `specchat serve`: a worker thread that runs requests one at a time, in
arrival order, from a bounded queue; and the counters ``/metrics`` shows.

Contract: :meth:`EngineOwner.submit` puts a request in the queue and returns its :class:`Job` at once, or raises
:class:`Busy` when ``queue_size`` requests are already waiting (the server answers 503). The worker iterates
``engine.generate(request, job.cancel)`` (the engine API only) and hands each StepEvent to the job's own queue;
an exception raised by the engine ends the job with that exception; then :data:`END`. A job cancelled while it
waits is skipped. :meth:`close` cancels the running job, ends the waiting ones and stops the worker. Requests carry
no conversation key (app/serve/boundary.py), so each is prefilled whole and frees its KV blocks when it ends.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from specchat.backend.api import EngineAPI, GenerationRequest, RequestStats

END = object()  # the last item of a job's event queue


class Busy(Exception):
    """The queue is full."""


@dataclass
class Job:
    request: GenerationRequest
    cancel: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # StepEvent | Exception | END


class Metrics:
    """Counters since the server started, read by ``/metrics`` (Prometheus text format)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # outcome -> count
        self.tokens = {"prompt": 0, "generated": 0, "drafted": 0, "accepted": 0}
        self.accepted_per_position: Counter[int] = Counter()
        self.reached_per_position: Counter[int] = Counter()

    def count(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def finished(self, stats: RequestStats | None, outcome: str) -> None:
        """One request ended: its totals, and its per-position counts (the steps that reached / accepted each
        draft position, every drafter's added up), all from the engine's own step counts in ``stats``."""
        with self._lock:
            self.requests[outcome] += 1
            if stats is None:
                return
            self.tokens["prompt"] += stats.prompt_tokens
            self.tokens["generated"] += stats.new_tokens
            self.tokens["drafted"] += stats.drafted or 0
            self.tokens["accepted"] += stats.accepted or 0
            counts = stats.step_counts or {}
            for key, total in (("reached", self.reached_per_position), ("accepted_at", self.accepted_per_position)):
                for row in counts.get(key, {}).values():
                    total.update({j: n for j, n in enumerate(row) if n})

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": dict(self.requests),
                "tokens": dict(self.tokens),
                "accepted_per_position": dict(self.accepted_per_position),
                "reached_per_position": dict(self.reached_per_position),
            }


class EngineOwner:
    """See the module docstring."""

    def __init__(self, engine: EngineAPI, *, queue_size: int, metrics: Metrics | None = None) -> None:
        self.engine, self.queue_size = engine, queue_size
        self.metrics = metrics or Metrics()
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._running = 0
        self._current: Job | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="specchat-serve-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def running(self) -> int:
        return self._running

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Busy() from None
        return job

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancel.is_set():
                job.events.put(END)
                continue
            with self._lock:
                self._running, self._current = 1, job
            try:
                for event in self.engine.generate(job.request, job.cancel):
                    job.events.put(event)
            except Exception as error:  # noqa: BLE001 - handed to the request's thread, which answers with it
                job.events.put(error)
            finally:
                with self._lock:
                    self._running, self._current = 0, None
                job.events.put(END)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: waiting jobs end at once, the running one is cancelled (the engine stops at its next step)."""
        with self._lock:
            if self._current is not None:
                self._current.cancel.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.events.put(END)
        try:
            self._jobs.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)
