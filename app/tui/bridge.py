"""The bridge from the engine's step generator (a worker thread) to the UI thread.

Contract:
- :func:`run_generation` runs in the generation worker thread. It iterates ``engine.generate(request,
  cancel)``, pushes every :class:`StepEvent` into a :class:`ReplyBuffer` and calls ``notify()`` at most once
  per ``interval_s`` (plus once at the very end), so the UI gets ~10 nudges a second however fast tokens come.
  It never raises: an exception ends the reply with ``finish_reason="error"`` and the exception in the
  outcome. It never touches a widget. ``interval_s`` may be a callable (the UI adapts it to its CPU cost).
- The UI thread calls :meth:`ReplyBuffer.drain` (idempotent, cheap) on each nudge, and once more after the
  worker has ended, and gets the new text, the new (token text, source) pairs, a :class:`LiveView` and,
  once, the :class:`ReplyOutcome`.
- A request's prefill progress events (``StepEvent.prefill_done``) set ``LiveView.prefill``; they are not
  steps and change neither the text nor the statistics.
- Statistics are the engine's own (``StepEvent.stats``, a :class:`~specchat.backend.api.RequestStats`, computed
  by ``backend/speculative/stats.py``): the UI counts nothing itself but tokens/s over the last second, so the live
  line, the reply's totals, `specchat generate --json` and the history show the same numbers.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specchat.backend.api import EngineAPI, GenerationRequest, RequestStats, StepEvent, TokenSource

RATE_WINDOW_S = 1.0  # tokens/s shown live is measured over the last second


@dataclass(frozen=True, slots=True)
class LiveView:
    """What the UI shows of a reply now: the engine's statistics after the latest step, the drafter that step
    used, tokens/s over the last :data:`RATE_WINDOW_S` (None until two events arrived) and, while the prompt is
    read, ``prefill`` = (tokens read, tokens to read, monotonic time the reading began)."""

    stats: RequestStats = field(default_factory=RequestStats)
    drafter: str = "none"
    window_tok_s: float | None = None
    prefill: tuple[int, int, float] | None = None


class RateWindow:
    """Tokens per second over the last ``window_s`` seconds of events (wall clock of the worker thread)."""

    def __init__(self, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s, self._clock = window_s, clock
        self._events: deque[tuple[float, int]] = deque()  # (time, tokens emitted so far)
        self._tokens = 0

    def add(self, tokens: int) -> None:
        now = self._clock()
        self._tokens += tokens
        self._events.append((now, self._tokens))
        while self._events and now - self._events[0][0] > self._window_s:
            self._events.popleft()

    def rate(self) -> float | None:
        if len(self._events) < 2:
            return None
        (t0, n0), (t1, n1) = self._events[0], self._events[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


@dataclass(slots=True)
class ReplyOutcome:
    """How a reply ended. ``stats`` is the engine's totals (the `generate --json` "stats" object) or None."""

    finish_reason: str
    stats: RequestStats | None = None
    message: str | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class ReplyDelta:
    """What a drain returns: new text and tokens since the last drain, current stats, the end (once)."""

    text: str
    tokens: list[tuple[str, TokenSource]]
    live: LiveView
    notices: list[str]
    outcome: ReplyOutcome | None


class ReplyBuffer:
    """Thread-safe hand-over of one reply from the worker (push/finish) to the UI thread (drain)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._text: list[str] = []
        self._tokens: list[tuple[str, TokenSource]] = []
        self._notices: list[str] = []
        self._rate = RateWindow(clock=clock)
        self._live = LiveView()
        self._outcome: ReplyOutcome | None = None
        self._outcome_taken = False

    def push(self, event: StepEvent) -> None:
        with self._lock:
            if event.prefill_done is not None:  # reading the prompt: no tokens, no statistics yet
                started = self._live.prefill[2] if self._live.prefill is not None else self._clock()
                self._live = LiveView(
                    self._live.stats, event.drafter, None, (event.prefill_done, event.prefill_tokens, started)
                )
                return
            self._rate.add(len(event.token_ids))
            self._live = LiveView(event.stats or self._live.stats, event.drafter, self._rate.rate(), self._live.prefill)
            if event.text:
                self._text.append(event.text)
            texts = event.token_texts if len(event.token_texts) == len(event.sources) else [""] * len(event.sources)
            self._tokens.extend(zip(texts, event.sources, strict=True))
            if event.message and event.finish_reason is None:
                self._notices.append(event.message)

    def finish(self, outcome: ReplyOutcome) -> None:
        with self._lock:
            if self._outcome is None:
                self._outcome = outcome

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._outcome is not None

    def drain(self) -> ReplyDelta:
        with self._lock:
            outcome = None
            if self._outcome is not None and not self._outcome_taken:
                outcome, self._outcome_taken = self._outcome, True
            delta = ReplyDelta("".join(self._text), self._tokens, self._live, self._notices, outcome)
            self._text, self._tokens, self._notices = [], [], []
            return delta


def run_generation(
    engine: EngineAPI,
    request: GenerationRequest,
    cancel: threading.Event,
    buffer: ReplyBuffer,
    notify: Callable[[], object],  # its result is ignored (Textual's post_message says whether it was queued)
    *,
    interval_s: float | Callable[[], float] = 0.1,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Drive one reply to its end in the calling (worker) thread. Never raises; see the module docstring.

    ``interval_s`` may be a callable, read at every event: the UI lengthens it when drawing gets expensive.
    """
    interval = interval_s if callable(interval_s) else (lambda: interval_s)
    last_notify = float("-inf")
    final: StepEvent | None = None
    outcome: ReplyOutcome
    events = None
    try:
        events = engine.generate(request, cancel)
        for event in events:
            buffer.push(event)
            if event.finish_reason is not None:
                final = event
            now = clock()
            if now - last_notify >= interval():
                notify()
                last_notify = now
        if final is not None and final.finish_reason is not None:
            outcome = ReplyOutcome(final.finish_reason, final.stats, final.message)
        elif cancel.is_set():
            outcome = ReplyOutcome("cancelled")
        else:
            outcome = ReplyOutcome("error", message="the engine stopped without reporting why (see the log)")
    except Exception as error:  # noqa: BLE001 - reported to the UI, which logs non-user errors with traceback
        outcome = ReplyOutcome("error", message=str(error) or type(error).__name__, error=error)
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - the reply is already over; closing is best effort
                pass
    buffer.finish(outcome)
    notify()


def step_name(message: str) -> str:
    """A loader message without its counters ("Loading weights: 3/30" -> "Loading weights")."""
    return re.sub(r":\s*\d.*$", "", message).strip() or message


class ThrottledProgress:
    """A loader ``progress(message, fraction)`` callback that posts at most ~10 messages a second.

    A new step (:func:`step_name` of the message changes) always posts, as does a fraction of 1; updates within
    a step (its fraction, its counters in the text) are throttled.
    """

    def __init__(
        self,
        post: Callable[[str, float | None], object],  # its result is ignored
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._post, self._interval, self._clock = post, interval_s, clock
        self._last_step: str | None = None
        self._last_time = float("-inf")

    def __call__(self, message: str, fraction: float | None = None) -> None:
        now, step = self._clock(), step_name(message)
        if step != self._last_step or now - self._last_time >= self._interval or fraction == 1.0:
            self._last_step, self._last_time = step, now
            self._post(message, fraction)
