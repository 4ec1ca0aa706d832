"""The compute-thread governor (backend/engine/threads.py): fewer threads while other programs use the cores."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from specchat.backend.engine import threads
from specchat.backend.engine.threads import Reading, ThreadGovernor, read_proc, wanted_threads

TICKS = 100.0  # clock ticks a second in the fake readings


class FakeProc:
    """Readings where other programs use ``others`` cores and this process ``own`` cores, ``step`` s apart."""

    def __init__(self) -> None:
        self.busy, self.own, self.wall = 0, 0, 0.0
        self.others, self.own_rate = 0.0, 1.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.own += round(self.own_rate * seconds * TICKS)
        self.busy += round((self.own_rate + self.others) * seconds * TICKS)

    def read(self, cores: frozenset[int]) -> Reading:
        return Reading(busy_ticks=self.busy, own_ticks=self.own, wall_s=self.wall)


def _governor(proc: FakeProc, monkeypatch, most: int = 2) -> tuple[ThreadGovernor, list[int]]:
    monkeypatch.setattr(threads.time, "monotonic", lambda: proc.wall)
    monkeypatch.setattr(threads, "_ticks_per_second", lambda: TICKS)
    calls: list[int] = []
    current = {"n": most}

    def set_threads(n: int) -> None:
        calls.append(n)
        current["n"] = n

    governor = ThreadGovernor(
        reader=proc.read,
        set_threads=set_threads,
        get_threads=lambda: current["n"],
        most=most,
        cores=frozenset(range(2)),
    )
    return governor, calls


def test_a_busy_core_elsewhere_drops_a_thread_at_once_and_it_comes_back_after_two_quiet_readings(monkeypatch):
    proc = FakeProc()
    governor, calls = _governor(proc, monkeypatch)
    proc.advance(0.6)
    assert governor.step() == 2 and calls == []  # quiet: two threads
    proc.others = 1.0  # a CPU-bound program starts
    proc.advance(0.6)
    assert governor.step() == 1 and calls == [1]  # the first reading that asks for fewer
    assert governor.others == pytest.approx(1.0, abs=0.05)
    proc.advance(0.2)
    assert governor.step() == 1  # no reading before the interval
    proc.others = 0.0  # it stops
    proc.advance(0.6)
    assert governor.step() == 1  # one quiet reading is not enough to add a thread back
    proc.advance(0.6)
    assert governor.step() == 2 and calls == [1, 2]


def test_a_quiet_reading_between_busy_ones_does_not_bring_threads_back(monkeypatch):
    proc = FakeProc()
    governor, calls = _governor(proc, monkeypatch)
    for others in (1.0, 0.0, 1.0, 0.0, 1.0):
        proc.others = others
        proc.advance(0.6)
        governor.step()
    assert governor.threads == 1 and calls == [1]


def test_a_terminal_redrawing_the_reply_keeps_both_threads(monkeypatch):
    proc = FakeProc()
    governor, calls = _governor(proc, monkeypatch)
    proc.others = 0.3
    for _ in range(5):
        proc.advance(0.6)
        governor.step()
    assert governor.threads == 2 and calls == []


def test_a_thread_that_runs_a_later_request_gets_the_count_again(monkeypatch):
    proc = FakeProc()
    governor, calls = _governor(proc, monkeypatch)
    proc.others = 1.0
    proc.advance(0.6)
    governor.step()
    governor._get = lambda: 2  # type: ignore[method-assign]  # another thread: its own OpenMP count
    proc.advance(0.1)
    governor.step()
    assert calls == [1, 1]


@pytest.mark.parametrize(
    ("cores", "others", "most", "expected"),
    [(2, 0.0, 2, 2), (2, 0.5, 2, 2), (2, 0.6, 2, 1), (2, 1.9, 2, 1), (8, 2.2, 8, 6), (8, 0.0, 4, 4), (4, 9.0, 4, 1)],
)
def test_wanted_threads(cores, others, most, expected):
    assert wanted_threads(cores, others, most) == expected


def test_switched_off_or_single_threaded_it_changes_nothing(monkeypatch):
    proc = FakeProc()
    monkeypatch.setenv(threads.ENV_SWITCH, "0")
    governor, calls = _governor(proc, monkeypatch)
    assert not governor.enabled
    monkeypatch.delenv(threads.ENV_SWITCH)
    single, _ = _governor(proc, monkeypatch, most=1)
    assert not single.enabled
    proc.others = 2.0
    proc.advance(1.0)
    assert governor.step() == 2 and single.step() == 1 and calls == []


def test_unreadable_proc_disables_it(monkeypatch):
    governor = ThreadGovernor(
        reader=lambda cores: None, set_threads=lambda n: None, get_threads=lambda: 2, most=2, cores=frozenset(range(2))
    )
    assert not governor.enabled and governor.step() == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_real_readings_see_another_process_busy():
    cores = frozenset([min(threads._allowed_cores())])
    loop = (
        f"import os, time\nos.sched_setaffinity(0, {set(cores)!r})\n"
        "end = time.time() + 3\nwhile time.time() < end: pass"
    )
    busy = subprocess.Popen([sys.executable, "-c", loop])
    try:
        time.sleep(0.5)
        before = read_proc(cores)
        time.sleep(1.0)
        after = read_proc(cores)
    finally:
        busy.kill()
        busy.wait()
    assert before is not None and after is not None
    others = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    assert others / threads._ticks_per_second() / (after.wall_s - before.wall_s) > 0.7  # the loop owns that core


def test_the_engine_consults_the_governor_before_every_pass():
    """Wired in: a reply on CPU asks the governor before the prefill and before every step, and a changed
    count takes effect for the passes that follow (torch's count in the generating thread)."""
    import torch
    from engine_fixtures import tiny_engine
    from tiny_models import random_ids

    from specchat.backend.api import GenerationRequest, SamplingParams

    engine = tiny_engine("llama", drafter="none")
    assert isinstance(engine.threads, ThreadGovernor)  # a CPU engine has one
    seen: list[int] = []

    class Counting:
        threads = 1

        def step(self) -> int:
            torch.set_num_threads(1)
            seen.append(torch.get_num_threads())
            return 1

    engine.threads = Counting()  # type: ignore[assignment]
    before = torch.get_num_threads()
    try:
        events = list(
            engine.generate(
                GenerationRequest(
                    prompt_ids=random_ids(20),
                    drafter="none",
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=6),
                )
            )
        )
    finally:
        torch.set_num_threads(before)
    steps = sum(1 for e in events if e.token_ids and not e.is_prefill)
    assert len(seen) == steps + 1 and set(seen) == {1}  # the prefill's chunk and each step


def test_loading_runs_in_a_thread_of_its_own_that_ends():
    """load_engine runs in a thread that ends when it returns (its OpenMP pool with it: threads.py), handing back
    the result or the exception."""
    import threading

    from specchat.backend.engine.engine import load_engine
    from specchat.backend.engine.threads import in_a_thread_of_its_own

    seen: list[threading.Thread] = []

    @in_a_thread_of_its_own
    def work(value: int) -> int:
        seen.append(threading.current_thread())
        if value < 0:
            raise ValueError("negative")
        return value * 2

    assert work(21) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="negative"):
        work(-1)
    assert getattr(load_engine, "__wrapped__", None) is not None  # load_engine runs so
