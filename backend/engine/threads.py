"""Fewer compute threads while other programs keep this machine's cores busy.

Why: PyTorch's CPU kernels run on an OpenMP pool, one thread per core, whose threads wait for each other at
the end of every parallel operation (a decoding pass has ~120). When another program keeps a core busy, one
of them keeps losing that core and the other waits for it at each barrier: on a 2-core machine with a CPU-bound loop
beside it, a reply on two threads all but stalled while one thread ran at nearly its quiet speed
(``benchmarks/RESULTS.md``, "Other programs on the cores"). With the machine to itself, two threads are the faster
choice, so the count has to follow what the others use.

How: :class:`ThreadGovernor` reads, at most every ``interval`` seconds of wall time, how much CPU time the
cores this process may run on spent busy (Linux ``/proc/stat``: user, nice, system, irq, softirq, steal) and
how much of it was this process's own (``/proc/self/stat``: utime + stime); the rest is other programs'. It
then asks for ``floor(cores - others + 0.5)`` threads (between 1 and the count it started with): more than
half a core of others' work drops a thread, because a thread that is preempted half the time stalls the
other at every barrier, while a terminal redrawing the reply (a tenth of a core or two) does not. Threads go
at the first reading that asks for fewer (one pass on too many threads can take seconds); they come back when
two readings in a row ask for more (a short lull elsewhere does not flip it back): with one thread this
process leaves a core idle, and the readings show when the others stop. The first reading may come after
``FIRST_S``: a request that starts right after loading may be the one that crawls.

The engine calls :meth:`ThreadGovernor.step` between passes (never inside one). It changes nothing where the
readings are unavailable (not Linux), where the process started with one thread (``OMP_NUM_THREADS=1``, or
``torch.set_num_threads(1)`` before loading), or with ``SPECCHAT_ADAPT_THREADS=0``. The count in use is
:attr:`ThreadGovernor.threads`; every change is logged.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from specchat.backend.kernels import switched_off

T = TypeVar("T")

log = logging.getLogger(__name__)

ENV_SWITCH = "SPECCHAT_ADAPT_THREADS"
INTERVAL_S = 0.5  # wall time between two readings
FIRST_S = 0.1  # wall time before the first reading after the one at construction
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpuN: user nice system idle iowait irq softirq steal ...


@dataclass(frozen=True, slots=True)
class Reading:
    """CPU time, in clock ticks, of the allowed cores (busy) and of this process, at one moment."""

    busy_ticks: int
    own_ticks: int
    wall_s: float


def read_proc(cores: frozenset[int]) -> Reading | None:
    """The current :class:`Reading` from ``/proc`` for the cores in ``cores``, or None where it is unreadable."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            busy = 0
            for line in stat:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
                    continue
                values = rest.split()
                busy += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
        with open("/proc/self/stat", encoding="ascii") as own:
            fields = own.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        return Reading(busy_ticks=busy, own_ticks=int(fields[11]) + int(fields[12]), wall_s=time.monotonic())
    except (OSError, ValueError, IndexError):
        return None


def wanted_threads(cores: int, others: float, most: int) -> int:
    """The thread count for ``others`` cores' worth of other programs' work on ``cores`` cores."""
    return max(1, min(most, math.floor(cores - others + 0.5)))


class ThreadGovernor:
    """See the module docstring. ``reader`` and ``set_threads`` are the system's; tests pass their own."""

    def __init__(
        self,
        *,
        reader: Callable[[frozenset[int]], Reading | None] = read_proc,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        get_threads: Callable[[], int] = torch.get_num_threads,
        most: int | None = None,
        cores: frozenset[int] | None = None,
        interval: float = INTERVAL_S,
    ) -> None:
        self.most = most if most is not None else get_threads()
        self.cores = cores if cores is not None else _allowed_cores()
        self.threads = self.most
        self._reader, self._set, self._get, self._interval = reader, set_threads, get_threads, interval
        self._ticks_per_s = _ticks_per_second()
        self.enabled = self.most > 1 and len(self.cores) > 1 and not switched_off(ENV_SWITCH)
        self._last = reader(self.cores) if self.enabled else None
        self.enabled = self.enabled and self._last is not None
        self._proposal: int | None = None
        self._read = False  # whether a reading (after the one at construction) was taken
        self.others = 0.0  # the last reading: other programs' work, in cores

    def step(self) -> int:
        """Take a reading if one is due and change the thread count if two readings in a row ask for the same
        other count. Returns the count in use. Call it from the thread that runs the passes: an OpenMP thread
        count belongs to the thread that sets it (a request served by another thread gets it set again)."""
        if not self.enabled or self._last is None:
            return self.threads
        if self._get() != self.threads:
            self._set(self.threads)
        if time.monotonic() - self._last.wall_s < (self._interval if self._read else min(FIRST_S, self._interval)):
            return self.threads
        now = self._reader(self.cores)
        if now is None:
            return self.threads
        wall = now.wall_s - self._last.wall_s
        if wall <= 0:
            return self.threads
        others_ticks = (now.busy_ticks - self._last.busy_ticks) - (now.own_ticks - self._last.own_ticks)
        self._last, self._read = now, True
        self.others = max(0.0, others_ticks / self._ticks_per_s / wall)
        wanted = wanted_threads(len(self.cores), self.others, self.most)
        log.debug(
            "thread reading: others %.2f cores over %.2f s, wanted %d, in use %d",
            self.others,
            wall,
            wanted,
            self.threads,
        )
        if wanted == self.threads:
            self._proposal = None
        elif wanted < self.threads or wanted == self._proposal:
            log.info(
                "compute threads %d -> %d: other programs use %.1f of %d cores",
                self.threads,
                wanted,
                self.others,
                len(self.cores),
            )
            self._set(wanted)
            self.threads, self._proposal = wanted, None
        else:
            self._proposal = wanted
        return self.threads


def _allowed_cores() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def _ticks_per_second() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


def in_a_thread_of_its_own(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run in a thread that ends when it returns (its result or its exception handed back to the caller).

    Why: OpenMP keeps a pool of compute threads for every thread that has run a parallel region, for that thread's
    life; once two pools exist on a machine with as many cores as one pool's threads, libgomp stops its threads
    spinning between regions and a pass of the native model takes more than twice as long (benchmarks/RESULTS.md,
    "Passes in a second thread"). Loading runs torch's parallel
    regions; passes run later in another thread (serve's owner, the batch scheduler, the UI's worker). Loading in a
    thread of its own frees its pool when it ends, so the thread that runs the passes has the only one.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                box["result"] = fn(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001 - handed to the caller, which raises it
                box["error"] = error

        thread = threading.Thread(target=body, name=f"specchat-{fn.__name__}", daemon=True)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["result"]

    return run
