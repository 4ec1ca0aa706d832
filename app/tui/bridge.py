"""The bridge from the engine's step generator (a worker thread) to the UI thread.

Contract:
- :func:`run_generation` runs in the generation worker thread. It iterates ``engine.generate(request,
  cancel)``, pushes every :class:`StepEvent` into a :class:`ReplyBuffer` and calls ``notify()`` at most once
  per ``interval_s`` (plus once at the very end), so the UI gets ~10 nudges a second however fast tokens come.
  It never raises: an exception ends the reply with ``finish_reason="error"`` and the exception in the
  outcome. It never touches a widget. ``interval_s`` may be a callable (the UI adapts it to its CPU cost).
- The UI thread calls :meth:`ReplyBuffer.drain` (idempotent, cheap) on each nudge, and once more after the
  worker has ended, and gets the new text, the new (token text, source) pairs, a :class:`LiveStats` snapshot
  and, once, the :class:`ReplyOutcome`.
- :class:`StatsTracker` derives the live statistics from the events (wall-clock timed in the worker).

Definitions follow design.md and backend/spec/stats.py: acceptance rate = accepted / drafted; mean accepted
length τ = 1 + accepted / speculative steps (tokens per verification pass, bonus or recovered included);
per-position acceptance i = P(position i accepted | positions < i accepted).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from specchat.backend.api import GenerationRequest, PolicyState, StepEvent, TokenSource

RATE_WINDOW_S = 1.0  # tokens/s shown live is measured over the last second


class EngineLike(Protocol):
    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None): ...
    def forget(self, conversation: str) -> None: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class LiveStats:
    """A snapshot of one reply's statistics so far. Rates are None when there is nothing to count."""

    new_tokens: int = 0
    elapsed_s: float = 0.0
    ttft_s: float | None = None
    tok_s: float | None = None  # over the last RATE_WINDOW_S
    tok_s_avg: float | None = None  # new_tokens / elapsed, prefill included (like `generate`'s tok_s)
    steps: int = 0  # target passes after prefill
    paused_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    gamma: int = 0  # γ of the latest step
    drafter: str = "none"
    policy: PolicyState | None = None
    per_position_acceptance: list[float | None] = field(default_factory=list)
    spec_tok_s: float | None = None  # tokens/s of speculative steps (step time, not wall clock)
    plain_tok_s: float | None = None  # tokens/s of plain target steps, when the policy paused speculation


class StatsTracker:
    """Accumulates counters from StepEvents; ``snapshot()`` derives the rates. Not thread safe by itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._last = self._start
        self._ttft: float | None = None
        self._tokens = 0
        self._steps = 0
        self._paused = 0
        self._drafted = 0
        self._accepted = 0
        self._spec_steps = 0  # steps that verified a draft
        self._gamma = 0
        self._drafter = "none"
        self._policy: PolicyState | None = None
        self._reached: list[int] = []  # per position: steps that drafted it with every earlier one accepted
        self._kept: list[int] = []  # per position: of those, accepted
        self._spec = [0, 0.0]  # tokens, seconds
        self._plain = [0, 0.0]
        self._window: deque[tuple[float, int]] = deque()

    def start(self) -> None:
        self._start = self._last = self._clock()

    def observe(self, event: StepEvent) -> None:
        now = self._clock()
        self._last = now
        emitted = len(event.token_ids)
        self._tokens += emitted
        if self._ttft is None and emitted:
            self._ttft = now - self._start
        self._gamma, self._drafter, self._policy = event.gamma, event.drafter, event.policy
        self._window.append((now, self._tokens))
        while self._window and now - self._window[0][0] > RATE_WINDOW_S:
            self._window.popleft()
        if event.is_prefill:
            return
        self._steps += 1
        step_s = event.draft_s + event.verify_s + event.overhead_s
        if event.gamma > 0:
            self._spec_steps += 1
            self._drafted += event.gamma
            self._accepted += event.accepted
            if len(self._reached) < event.gamma:
                grow = event.gamma - len(self._reached)
                self._reached += [0] * grow
                self._kept += [0] * grow
            for i in range(min(event.gamma, event.accepted + 1)):
                self._reached[i] += 1
                if i < event.accepted:
                    self._kept[i] += 1
            self._spec[0] += emitted
            self._spec[1] += step_s
        else:
            if event.policy == PolicyState.PAUSED:
                self._paused += 1
            self._plain[0] += emitted
            self._plain[1] += step_s

    def snapshot(self) -> LiveStats:
        elapsed = self._last - self._start
        rate = None
        if len(self._window) >= 2:
            (t0, n0), (t1, n1) = self._window[0], self._window[-1]
            if t1 > t0:
                rate = (n1 - n0) / (t1 - t0)
        elif self._tokens and elapsed > 0:
            rate = self._tokens / elapsed
        return LiveStats(
            new_tokens=self._tokens,
            elapsed_s=elapsed,
            ttft_s=self._ttft,
            tok_s=rate,
            tok_s_avg=self._tokens / elapsed if self._tokens and elapsed > 0 else None,
            steps=self._steps,
            paused_steps=self._paused,
            drafted=self._drafted,
            accepted=self._accepted,
            acceptance_rate=self._accepted / self._drafted if self._drafted else None,
            mean_accepted_length=1.0 + self._accepted / self._spec_steps if self._spec_steps else None,
            gamma=self._gamma,
            drafter=self._drafter,
            policy=self._policy,
            per_position_acceptance=[k / r if r else None for k, r in zip(self._kept, self._reached, strict=True)],
            spec_tok_s=self._spec[0] / self._spec[1] if self._spec[1] > 0 else None,
            plain_tok_s=self._plain[0] / self._plain[1] if self._plain[1] > 0 else None,
        )


_FINAL_KEYS = {  # LiveStats field <- key of the engine's final stats (the `generate --json` "stats" object)
    "new_tokens": "new_tokens", "elapsed_s": "wall_s", "ttft_s": "ttft_s", "tok_s_avg": "tok_s", "steps": "steps",
    "paused_steps": "spec_paused_steps", "drafted": "drafted", "accepted": "accepted",
    "acceptance_rate": "acceptance_rate", "mean_accepted_length": "mean_accepted_length",
    "per_position_acceptance": "per_position_acceptance",
}


def with_final_stats(live: LiveStats, stats: dict[str, Any] | None) -> LiveStats:
    """``live`` with the engine's final totals where it reports them, so every display agrees with them."""
    if not stats:
        return live
    merged = replace(live)
    for name, key in _FINAL_KEYS.items():
        value = stats.get(key)
        if value is not None and (isinstance(value, (int, float, list)) and not isinstance(value, bool)):
            setattr(merged, name, value)
    return merged


@dataclass(slots=True)
class ReplyOutcome:
    """How a reply ended. ``stats`` is the engine's totals (the `generate --json` "stats" object) or None."""

    finish_reason: str
    stats: dict[str, Any] | None = None
    message: str | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class ReplyDelta:
    """What a drain returns: new text and tokens since the last drain, current stats, the end (once)."""

    text: str
    tokens: list[tuple[str, TokenSource]]
    live: LiveStats
    notices: list[str]
    outcome: ReplyOutcome | None


class ReplyBuffer:
    """Thread-safe hand-over of one reply from the worker (push/finish) to the UI thread (drain)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._tokens: list[tuple[str, TokenSource]] = []
        self._notices: list[str] = []
        self._tracker = StatsTracker(clock)
        self._outcome: ReplyOutcome | None = None
        self._outcome_taken = False

    def start(self) -> None:
        with self._lock:
            self._tracker.start()

    def push(self, event: StepEvent) -> None:
        with self._lock:
            self._tracker.observe(event)
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
            delta = ReplyDelta("".join(self._text), self._tokens, self._tracker.snapshot(), self._notices, outcome)
            self._text, self._tokens, self._notices = [], [], []
            return delta


def run_generation(engine: EngineLike, request: GenerationRequest, cancel: threading.Event, buffer: ReplyBuffer,
                   notify: Callable[[], None], *, interval_s: float | Callable[[], float] = 0.1,
                   clock: Callable[[], float] = time.monotonic) -> None:
    """Drive one reply to its end in the calling (worker) thread. Never raises; see the module docstring.

    ``interval_s`` may be a callable, read at every event: the UI lengthens it when drawing gets expensive.
    """
    interval = interval_s if callable(interval_s) else (lambda: interval_s)
    buffer.start()
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
        if final is not None:
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


class ThrottledProgress:
    """A loader ``progress(message, fraction)`` callback that posts at most ~10 messages a second.

    A change of message text always posts (stages are few); fraction-only updates are throttled.
    """

    def __init__(self, post: Callable[[str, float | None], None], interval_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._post, self._interval, self._clock = post, interval_s, clock
        self._last_text: str | None = None
        self._last_time = float("-inf")

    def __call__(self, message: str, fraction: float | None = None) -> None:
        now = self._clock()
        if message != self._last_text or now - self._last_time >= self._interval or fraction == 1.0:
            self._last_text, self._last_time = message, now
            self._post(message, fraction)
