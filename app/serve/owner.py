"""The one owner of the engine behind `specchat serve`: a worker thread that runs requests one at a time, in
arrival order, from a bounded queue (or, with a :class:`Batch`, `serve --parallel N`, the batch's slots, its own
queue bounded the same way); and the counters ``/metrics`` shows.

Contract: :meth:`EngineOwner.submit` puts a request in the queue and returns its :class:`Job` at once, or raises
:class:`Busy` when ``queue_size`` requests are already waiting (the server answers 429). The worker iterates
``engine.generate(request, job.cancel)`` (the engine API only) and hands each StepEvent to the job's own queue,
calling ``job.notify()`` after each item (the HTTP side's event loop waits on it instead of a thread per
request), or, for a job submitted with ``wake_each=False`` (a non-streaming reply, read only when whole), only
after an exception or :data:`END`, so the event loop does not wake once per step to do nothing while the engine
computes; an exception raised by the engine ends the job with that exception; then :data:`END`. A job cancelled
while it waits is skipped. ``before_job`` (when given) runs in the worker before each job: `specchat serve` passes
the engine's ``forget_requests`` there, so that no request learns from another's (the default; an operator may
opt in to sharing). :meth:`cancel_all` cancels the running and waiting jobs (a server shutting down);
:meth:`close` also stops the worker. Requests carry no conversation key but a prefix-cache scope (their client:
app/serve/routes.py), so each prefills what its client's kept prompts do not hold (backend/engine/prefix_cache.py).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from specchat.backend.api import EngineAPI, GenerationRequest, RequestStats

END = object()  # the last item of a job's event queue


class Batch(Protocol):
    """Continuous batching (`serve --parallel N`: backend/engine/batch.py's BatchScheduler): up to ``slots``
    requests at once; ``submit`` hands it a request whose events (then an exception, if any, then None) go to
    ``sink``."""

    slots: int

    def submit(self, request: GenerationRequest, cancel: threading.Event, sink: Callable[[Any], None]) -> None: ...

    @property
    def waiting(self) -> int: ...

    @property
    def running(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, timeout_s: float = 10.0) -> None: ...


class Busy(Exception):
    """The queue is full."""


@dataclass
class Job:
    request: GenerationRequest
    cancel: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # StepEvent | Exception | END
    notify: Callable[[], None] | None = None  # called (from the worker thread) after each item is queued
    wake_each: bool = True  # False: notify only after an exception or END (the reader wants the whole reply)

    def put(self, item: object) -> None:
        self.events.put(item)
        if self.notify is not None and (self.wake_each or item is END or isinstance(item, BaseException)):
            self.notify()


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

    def __init__(
        self,
        engine: EngineAPI,
        *,
        queue_size: int,
        metrics: Metrics | None = None,
        before_job: Callable[[], None] | None = None,
        batch: Batch | None = None,
    ) -> None:
        self.engine, self.queue_size, self.before_job = engine, queue_size, before_job
        self.batch = batch  # None: one request at a time in the worker thread
        self._batched: dict[int, Job] = {}  # jobs handed to the batch (by id), until their END
        self.metrics = metrics or Metrics()
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._running = 0
        self._current: Job | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="specchat-serve-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self.batch.waiting if self.batch is not None else self._jobs.qsize()

    @property
    def running(self) -> int:
        return self.batch.running if self.batch is not None else self._running

    def metrics_lines(self) -> list[str]:
        """/metrics' lines of the batch (none without one): its slots, streams, rows per pass and the policy's
        choice (streams allowed to draft, and each one's γ cap)."""
        if self.batch is None:
            return []
        s = self.batch.stats()
        passes = s["passes"]
        gauges = {
            "specchat_batch_slots": s["slots"],
            "specchat_batch_streams": s["running"],
            "specchat_batch_last_pass_streams": s["last_streams"],
            "specchat_batch_last_pass_rows": s["last_rows"],
            "specchat_batch_rows_per_pass": round(s["rows"] / passes, 3) if passes else 0,
            "specchat_batch_speculating_streams": s["speculating_streams"],
        }
        lines = [f"# TYPE {name} gauge\n{name} {value}" for name, value in gauges.items()]
        lines += ["# TYPE specchat_batch_passes_total counter", f"specchat_batch_passes_total {passes}"]
        lines.append("# TYPE specchat_batch_gamma_cap gauge")
        lines += [
            f'specchat_batch_gamma_cap{{stream="{i}"}} {-1 if c is None else c}' for i, c in enumerate(s["gamma_caps"])
        ]
        return lines

    def _submit_batched(self, job: Job) -> Job:
        assert self.batch is not None
        with self._lock:
            if self.batch.waiting >= self.queue_size:
                raise Busy()
            self._batched[id(job)] = job

        def sink(item: Any) -> None:
            if item is None:
                with self._lock:
                    self._batched.pop(id(job), None)
                job.put(END)
            else:
                job.put(item)

        self.batch.submit(job.request, job.cancel, sink)
        return job

    def submit(
        self, request: GenerationRequest, notify: Callable[[], None] | None = None, *, wake_each: bool = True
    ) -> Job:
        job = Job(request, notify=notify, wake_each=wake_each)
        if self.batch is not None:
            return self._submit_batched(job)
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
                job.put(END)
                continue
            with self._lock:
                self._running, self._current = 1, job
            try:
                if self.before_job is not None:
                    self.before_job()
                for event in self.engine.generate(job.request, job.cancel):
                    job.put(event)
            except Exception as error:  # noqa: BLE001 - handed to the request's handler, which answers with it
                job.put(error)
            finally:
                with self._lock:
                    self._running, self._current = 0, None
                job.put(END)

    def cancel_all(self) -> None:
        """Cancel the running job and every waiting one (each still ends with END)."""
        with self._lock:
            if self._current is not None:
                self._current.cancel.set()
            for job in self._batched.values():
                job.cancel.set()
        for job in list(self._jobs.queue):
            if job is not None:
                job.cancel.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: waiting jobs end at once, the running one is cancelled (the engine stops at its next step)."""
        if self.batch is not None:
            self.cancel_all()
            self.batch.close(timeout_s)
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
                job.put(END)
        try:
            self._jobs.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)
