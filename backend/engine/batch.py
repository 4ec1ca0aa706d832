"""Continuous batching: the target passes of many requests in one pass, streams joining and leaving between passes.

Contract: :class:`BatchScheduler(engine, slots)` runs up to ``slots`` requests at once in its own thread
(``start()``; ``close()`` cancels every stream and stops it). :meth:`BatchScheduler.submit(request, cancel, sink)`
queues a request (thread-safe); ``sink`` receives each StepEvent of its reply, an exception if it fails, and None
when it has ended. Each reply is exactly the one ``Engine.generate`` gives the same request alone: the stream runs
the engine's own request loop (``Engine._generate``, ``RequestState``) with drafters and policies of its own, and
only its target passes are shared, on the CPU native model row for row as they are alone (docs/batching.md).

How: each stream's loop runs in a greenlet whose runner (:class:`_LaneRunner`) hands every target pass to the
scheduler and waits; when all wait, one pass runs over all their rows (``ModelRunner.forward_batch``) and each
stream resumes with its rows' logits. The schedule of a pass:
- every decoding stream's rows (its pending token and drafts), whole;
- then one prefill (the stream admitted first) for the rest of ``prefill_budget`` rows, at least
  ``MIN_PIECE``: a long prompt is read in pieces across passes (native model only; other paths prefill whole),
  and no decoding stream waits for more than one piece;
- a stream's prefill pass whose request was cancelled ends at once (nothing of it kept), as between two
  prefill chunks of a lone request; a cancelled decoding stream ends after the pass it is in.
Admission: a free slot, and free memory for the K/V of its context (prompt + max_new_tokens) beyond what the
active streams may still grow into; otherwise it waits (alone and still too big: InsufficientMemoryError).
Speculation per stream: backend/speculative/batch_policy.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import greenlet
import torch

from specchat.backend.api import GenerationRequest, StepEvent
from specchat.backend.engine import upgrade
from specchat.backend.engine.batch_lanes import kv_need, lane_for, lane_rows, release_lane
from specchat.backend.engine.forward_paths import Pass
from specchat.backend.engine.parts import Lane
from specchat.backend.errors import InsufficientMemoryError, KVCacheFullError
from specchat.backend.kernels.native_model import PassPart
from specchat.backend.kv.attention import PassCancelled
from specchat.backend.kv.kv_cache import kv_bytes_per_token
from specchat.backend.models.facts.memory import format_bytes, free_memory
from specchat.backend.speculative.batch_policy import PassCost, allocate
from specchat.backend.speculative.policy import _Median

if TYPE_CHECKING:
    from specchat.backend.engine.engine import Engine

Sink = Callable[[StepEvent | BaseException | None], None]
MIN_PIECE = 16  # prompt rows a pass reads at least while a prefill waits
DEFAULT_PREFILL_BUDGET = 64  # rows of a pass a prefill piece may fill up to (decoding rows first)
MEMORY_SPARE = 256 * 2**20  # free memory kept beyond the streams' K/V (activations, the server)
ALLOCATE_EVERY = 4  # passes between two allocations of γ while the streams stay the same


@dataclass
class _Ticket:
    """One target pass a stream waits on."""

    part: PassPart
    taps: tuple[int, ...] | None
    prefill: bool  # a prompt pass (cancellable; may run in pieces)
    done: int = 0  # rows already run (a prefill in pieces)


@dataclass
class _Stream:
    request: GenerationRequest
    cancel: threading.Event
    sink: Sink
    need_tokens: int  # K/V tokens its context may reach
    lane: Lane | None = None
    run: Any = None  # its greenlet
    ticket: _Ticket | None = None
    admitted: float = field(default_factory=time.perf_counter)
    rows: int = 0  # rows in the last pass


class _LaneRunner:
    """The runner a batched stream's request sees: ``forward`` waits for the scheduler's pass; the rest is the
    engine's runner."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def forward(self, seq, input_ids, *, logits_to_keep=1, parents=None, cancel=None, taps=None) -> Any:
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        ticket = _Ticket(PassPart(seq, ids, logits_to_keep, parents), taps, prefill=cancel is not None)
        hub = greenlet.getcurrent().parent
        result = hub.switch(ticket)
        if isinstance(result, BaseException):
            raise result
        return result


class BatchScheduler:
    """See the module docstring."""

    def __init__(
        self, engine: Engine, slots: int, *, prefill_budget: int = DEFAULT_PREFILL_BUDGET, share: bool = False
    ) -> None:
        self.engine, self.slots, self.prefill_budget = engine, max(int(slots), 1), max(prefill_budget, MIN_PIECE)
        self.share = share  # streams' suffix drafters read the engine's memory of replies (serve --share-state)
        self.cost = PassCost()
        self.between = _Median()  # seconds from the end of a pass to the start of the next (the streams' Python)
        self._pass_end: float | None = None
        self.active: list[_Stream] = []
        self._waiting: deque[_Stream] = deque()
        self._cond, self._closed = threading.Condition(), False
        self._thread: threading.Thread | None = None
        self._since_allocation = 0
        self._members: tuple[tuple[int, bool], ...] = ()
        cfg, dtype = engine.target.model.config, engine.target.dtype
        self.bytes_per_token = kv_bytes_per_token(cfg, dtype)
        if engine.draft is not None:
            self.bytes_per_token += kv_bytes_per_token(engine.draft.model.config, engine.draft.dtype)
        # Figures for /metrics and the per-stream view (read without the lock: plain ints and floats).
        self.passes = 0
        self.rows_total = 0
        self.last_rows = 0
        self.last_streams = 0
        self.draft_rows = 0  # rows of drafts verified (of rows_total)
        self.prefill_rows = 0  # rows of prompts read (of rows_total)
        self.speculating = 0  # streams the last allocation let draft
        self.caps: list[int | None] = []

    @property
    def runner(self) -> Any:
        """The engine's runner now (read each pass: the engine may swap its runners between requests)."""
        return self.engine.runner

    @property
    def native(self) -> bool:
        return self.engine.runner.native is not None

    # -- the caller's side ----------------------------------------------------------------------------------

    def start(self) -> BatchScheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specchat-batch", daemon=True)
            self._thread.start()
        return self

    def submit(self, request: GenerationRequest, cancel: threading.Event, sink: Sink) -> None:
        stream = _Stream(request, cancel, sink, need_tokens=0)
        with self._cond:
            self._waiting.append(stream)
            self._cond.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self.active)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            for stream in [*self.active, *self._waiting]:
                stream.cancel.set()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def stats(self) -> dict[str, Any]:
        """The batch now: streams running and waiting, passes, rows per pass, and the policy's choice."""
        return {
            "slots": self.slots,
            "running": self.running,
            "waiting": self.waiting,
            "passes": self.passes,
            "rows": self.rows_total,
            "last_rows": self.last_rows,
            "last_streams": self.last_streams,
            "draft_rows": self.draft_rows,
            "prefill_rows": self.prefill_rows,
            "speculating_streams": self.speculating,
            "gamma_caps": list(self.caps),
            "pass_cost_s": self.cost.curve(),
        }

    # -- the scheduler's thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self.active:
                    self._cond.wait()
                if self._closed and not self.active:
                    for stream in self._waiting:
                        stream.sink(None)
                    self._waiting.clear()
                    return
            with self.engine._lock:
                if not self.active:  # between replies: the native model, once kernels built meanwhile are ready
                    upgrade.between_replies(self.engine)
                self._admit()
                if self.active:
                    self._pass()

    def _admit(self) -> None:
        while len(self.active) < self.slots:
            with self._cond:
                if not self._waiting:
                    return
                stream = self._waiting[0]
            if stream.cancel.is_set():
                self._drop_waiting(stream)
                stream.sink(None)
                continue
            stream.need_tokens = kv_need(self.engine, stream.request)
            if not self._fits(stream):
                if self.active:
                    return  # it waits for a stream to end
                self._drop_waiting(stream)
                stream.sink(self._no_memory(stream))
                stream.sink(None)
                continue
            self._drop_waiting(stream)
            if not self.cost.curve():
                self._calibrate()
            stream.lane = lane_for(self.engine, _LaneRunner(self.runner), self.cost, share=self.share)
            stream.run = greenlet.greenlet(self._main)
            self.active.append(stream)
            self._resume(stream, stream)

    def _drop_waiting(self, stream: _Stream) -> None:
        with self._cond:
            self._waiting.remove(stream)

    def _growth_bytes(self) -> int:
        """Bytes the active streams' K/V may still grow by."""
        left = 0
        for stream in self.active:
            state = stream.lane.state if stream.lane is not None else None
            used = state.conv.seq.length if state is not None else 0
            left += max(stream.need_tokens - used, 0)
        return left * self.bytes_per_token

    def _fits(self, stream: _Stream) -> bool:
        need = stream.need_tokens * self.bytes_per_token
        return need + self._growth_bytes() + MEMORY_SPARE <= free_memory(self.runner.device)

    def _no_memory(self, stream: _Stream) -> InsufficientMemoryError:
        need = stream.need_tokens * self.bytes_per_token
        return InsufficientMemoryError(
            f"not enough free memory for this request's KV cache: its context may take {format_bytes(need)} "
            f"({stream.need_tokens} tokens) and {format_bytes(free_memory(self.runner.device))} is free; lower "
            "max_tokens, send a shorter prompt or free memory, then retry"
        )

    def _main(self, stream: _Stream) -> None:
        """A stream's greenlet: the engine's request loop, its events to the sink."""
        try:
            for event in self.engine._generate(stream.request, stream.cancel, lane=stream.lane):
                if event.stats is not None:  # the batch as this stream saw it (RequestStats.batch_*)
                    caps = [getattr(p, "cap", None) for p in stream.lane.policies.values()] if stream.lane else []
                    cap = next((c for c in caps if c is not None), None)
                    event.stats = replace(event.stats, batch_streams=self.last_streams, batch_gamma_cap=cap)
                stream.sink(event)
        except Exception as error:  # noqa: BLE001 - the request's failure goes to its caller, as generate raises it
            stream.sink(error)
        finally:
            release_lane(stream.lane)
            stream.ticket = None

    def _resume(self, stream: _Stream, value: Any) -> None:
        """Run ``stream`` until it waits on its next pass (its ticket) or ends (it leaves the batch)."""
        stream.ticket = None
        ticket = stream.run.switch(value)
        if stream.run.dead:
            self.active.remove(stream)
            stream.sink(None)
        else:
            stream.ticket = ticket

    def _calibrate(self) -> None:
        """T(R) for a few row counts, measured once on a scratch sequence (the allocation's first figures)."""
        seq = self.runner.cache.new_sequence()
        threads = self.engine.threads
        try:
            ids = torch.arange(16, 80, dtype=torch.long)
            self.runner.forward_batch([PassPart(seq, ids, 1)])
            seq.commit(64)
            for rows in (1, 2, 4, 8, 16, 32, 1, 2, 4, 8, 16, 32):
                if threads is not None:
                    threads.step()  # as between any two passes: fewer threads while other programs are busy
                t0 = time.perf_counter()
                self.runner.forward_batch([PassPart(seq, ids[:rows], rows)])
                self.cost.observe(rows, time.perf_counter() - t0)
        except (KVCacheFullError, RuntimeError):
            pass  # the batch's own passes measure it instead
        finally:
            seq.free()

    def _pass(self) -> None:
        parked = [s for s in self.active if s.ticket is not None]
        for stream in parked:
            assert stream.ticket is not None
            if stream.ticket.prefill and stream.cancel.is_set():
                stream.ticket.part.seq.truncate(stream.ticket.part.seq.length)
                self._resume(stream, PassCancelled())
        parked = [s for s in self.active if s.ticket is not None]
        decoding = [s for s in parked if s.ticket is not None and not s.ticket.prefill]
        prefilling = [s for s in parked if s.ticket is not None and s.ticket.prefill]
        chosen: list[tuple[_Stream, PassPart]] = []
        for stream in decoding:
            assert stream.ticket is not None
            chosen.append((stream, stream.ticket.part))
        rows = sum(part.ids.numel() for _, part in chosen)
        if prefilling:
            chosen.append((prefilling[0], self._piece(prefilling[0], rows)))
        live = []
        for stream, part in chosen:  # each sequence's slots first: a full cache fails that stream alone
            try:
                part.seq.reserve(part.offset + part.ids.numel())
                live.append((stream, part))
            except KVCacheFullError as error:
                self._resume(stream, error)
        if not live:
            return
        self._run(live)

    def _piece(self, stream: _Stream, decoding_rows: int) -> PassPart:
        ticket = stream.ticket
        assert ticket is not None
        part, n = ticket.part, ticket.part.ids.numel()
        if not self.native or ticket.taps is not None or part.keep != 1 or part.parents is not None:
            return part
        size = min(n - ticket.done, max(self.prefill_budget - decoding_rows, MIN_PIECE))
        if ticket.done == 0 and size == n:
            return part
        return PassPart(part.seq, part.ids[ticket.done : ticket.done + size], 1, offset=ticket.done)

    def _run(self, live: list[tuple[_Stream, PassPart]]) -> None:
        taps = next((s.ticket.taps for s, _ in live if s.ticket is not None and s.ticket.taps is not None), None)
        rows = sum(part.ids.numel() for _, part in live)
        self._set_caps(live)
        t0 = time.perf_counter()
        if self._pass_end is not None and len(live) == len(self.active):
            self.between.add(t0 - self._pass_end)
        try:
            results: list[Any] = self.runner.forward_batch([part for _, part in live], taps)
        except Exception as error:  # noqa: BLE001 - each stream's request handles its pass's failure
            results = [error] * len(live)
        self._pass_end = time.perf_counter()
        self.cost.observe(rows, self._pass_end - t0)
        self.passes += 1
        self.rows_total += rows
        self.last_rows, self.last_streams = rows, len(self.active)
        for (stream, part), result in zip(live, results, strict=True):
            ticket = stream.ticket
            assert ticket is not None
            stream.rows = part.ids.numel()
            if ticket.prefill:
                self.prefill_rows += stream.rows
            else:
                self.draft_rows += stream.rows - 1
            if ticket.taps is None and isinstance(result, Pass) and result.hidden is not None:
                result = Pass(result.logits)  # taps this stream did not ask for (a head drafts in another stream)
            ticket.done += part.ids.numel()
            if ticket.prefill and ticket.done < ticket.part.ids.numel() and not isinstance(result, BaseException):
                continue  # the rest of its prompt in the next passes
            self._resume(stream, result)

    def _set_caps(self, live: list[tuple[_Stream, PassPart]]) -> None:
        """Before the streams propose their next drafts: γ per stream for the batch as it is (batch_policy.py)."""
        lanes = [s.lane for s in self.active if s.lane is not None]
        members = tuple((id(s), s.ticket is not None and s.ticket.prefill) for s in self.active)
        shared = len(live) > 1
        for lane in lanes:
            for policy in lane.policies.values():
                policy.shared = shared  # type: ignore[attr-defined]
        self._since_allocation += 1
        if members == self._members and self._since_allocation < ALLOCATE_EVERY:
            return
        self._members, self._since_allocation = members, 0
        if len(self.active) <= 1:
            for lane in lanes:
                for policy in lane.policies.values():
                    policy.cap = None  # type: ignore[attr-defined]
            self.caps, self.speculating = [None] * len(lanes), 0
            return
        base, offers, who = lane_rows(self.active, self.cost.time(1))
        prefill = sum(1 for s in self.active if s.ticket is not None and s.ticket.prefill)
        between = self.between.value if self.between.samples else 0.0
        caps = allocate(offers, base + (self.prefill_budget if prefill else 0), self.cost, between)
        for lane, cap in zip(who, caps, strict=True):
            for policy in lane.policies.values():
                policy.cap = cap  # type: ignore[attr-defined]
        self.caps = list(caps)
        self.speculating = sum(1 for c in caps if c > 0)
