"""The steps of a pair's load as the loader names them, timed, for the stats bar's loading line (stats_bar.py).

:class:`LoadSteps` keeps each step's start (a clock for tests) and when the loader last said something new, so the
line can say a step is still working while its percentage sits still (a draft quantised at load sits long at one
percentage, issue 36); :func:`short_step` is a step's name for the "ready" note.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specchat.app.tui.bridge import step_name

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"  # the loading line's first cell, one frame per half-second tick
QUIET_S = 3.0  # a loader's percentage unchanged this long is said to be still working


def short_step(name: str) -> str:
    """A step's name for the "ready" note: without what it reads from or runs on, nor remarks in brackets."""
    name = re.sub(r"\s*\([^)]*\)", "", name)
    return re.sub(r"\s+(?:from|on|to)\s+\S.*$", "", name).strip() or name


@dataclass
class LoadSteps:
    """The steps of one load as the loader names them, with the time each took (a clock for tests)."""

    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)
    steps: list[tuple[str, float]] = field(default_factory=list)  # (name, start time)
    message: str = ""
    fraction: float | None = None
    reported: float = 0.0  # when the message or the fraction last changed

    def __post_init__(self) -> None:
        self.started = self.reported = self.clock()

    def report(self, message: str, fraction: float | None) -> None:
        name = step_name(message)
        if not self.steps or self.steps[-1][0] != name:
            self.steps.append((name, self.clock()))
        if (message, fraction) != (self.message, self.fraction):
            self.reported = self.clock()
        self.message, self.fraction = message, fraction

    def quiet_s(self) -> float:
        """Seconds since the loader last said something new (a percentage that sits still)."""
        return self.clock() - self.reported

    def step_elapsed(self) -> float:
        return self.clock() - (self.steps[-1][1] if self.steps else self.started)

    def total(self) -> float:
        return self.clock() - self.started

    def durations(self) -> list[tuple[str, float]]:
        """(step, seconds) of every step so far, the current one up to now."""
        ends = [start for _, start in self.steps[1:]] + [self.clock()]
        return [(name, end - start) for (name, start), end in zip(self.steps, ends)]
