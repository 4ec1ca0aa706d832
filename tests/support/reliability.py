"""Helpers of the reliability tests (issue 20): the fuzzers' runner, the soak scale, and the figures they count
(inputs tried per surface, kills per kind and how many the files survived, soak readings), which
tests/conftest.py prints at the end of the run.

``SCALES`` parametrizes a test with ``scale`` 1 (the default suite) and 10 (marked ``soak``: ``pytest -m soak``
runs ten times the inputs or kills). :func:`fuzz` runs ``check`` on ``examples`` inputs drawn from ``strategy``
with hypothesis (no deadline: the machine is shared) and counts each under ``surface``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCALES = pytest.mark.parametrize(
    "scale", [pytest.param(1, id="default"), pytest.param(10, id="soak", marks=pytest.mark.soak)]
)

FUZZED: Counter[str] = Counter()  # surface -> inputs tried
KILLS: Counter[str] = Counter()  # kind -> kill -9 sent
SURVIVED: Counter[str] = Counter()  # kind -> kills after which every check passed
READINGS: dict[str, str] = {}  # name -> a measured value, as text


def fuzz(surface: str, strategy: st.SearchStrategy[Any], check: Callable[[Any], None], examples: int) -> None:
    """Run ``check(value)`` for ``examples`` values of ``strategy``; a failing input is shrunk and reported."""

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(strategy)
    def run(value: Any) -> None:
        FUZZED[surface] += 1
        check(value)

    run()


def summary_lines() -> list[str]:
    lines = []
    if FUZZED:
        lines.append(
            f"fuzzed inputs: {sum(FUZZED.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(FUZZED.items())) + ")"
        )
    for kind in sorted(KILLS):
        lines.append(f"kill -9 of {kind}: {KILLS[kind]} sent, {SURVIVED[kind]} survived")
    lines += [f"{name}: {value}" for name, value in sorted(READINGS.items())]
    return lines


# -- structured garbage, shared by the fuzzers ---------------------------------------------------------------

UNICODE_DIGITS = "٠١٢٣٤٥٦٧٨٩۳߃३੩௩໓༣၃႓៣᠓᥇᧓᪃᭓᮳᱃᱓꘣꣓꤃꧓꩓꯳０１２３¹²³⁴"
CONTROL = "".join(chr(c) for c in range(32)) + "\x7f\x85\u2028\u2029\u202e\u200b\ufeff"
NASTY_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(st.sampled_from(UNICODE_DIGITS + "0123456789-+.eE "), min_size=1, max_size=12),
    st.text(st.sampled_from(CONTROL + "ab"), max_size=12),
    st.sampled_from(
        [
            "",
            " ",
            "auto",
            "nan",
            "NaN",
            "inf",
            "-inf",
            "Infinity",
            "1e400",
            "-0",
            "0x10",
            "1_000",
            "\ud800",
            "a\udcff",
            "𝟙𝟚",
            "null",
            "true",
            "[]",
            "{}",
            "9" * 5000,
            "-" * 3,
            "\n",
        ]
    ),
)
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**60), max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**63, 2**64, -(2**63) - 1, 1e-320, 5e-324, 1e308, 0.5, 31, 32, 64, 65]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, NASTY_TEXT)


class Raw(str):
    """Text written into a JSON or YAML document as it is (a 5,000-digit number, NaN, 50 levels of brackets)."""


JSON_RAW = st.one_of(
    st.sampled_from(
        [
            "9" * 5000,
            "-" + "1" * 4400,
            "1e400",
            "-1e999",
            "NaN",
            "Infinity",
            "-Infinity",
            "1" * 41,
            "0.0000000000000000000000000000000001e-400",
            "[1, 2",
            "{",
            "]",
            '"\\ud800"',
            '"\\udfff x"',
        ]
    ),
    st.integers(min_value=33, max_value=5000).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=33, max_value=500).map(lambda n: '{"a": ' * n + "1" + "}" * n),
)


def dump_json(value: Any) -> str:
    """JSON text of ``value``, with :class:`Raw` parts written as they are and NaN / Infinity as Python writes
    them (not JSON: the readers must refuse or name them)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(dump_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dump_json(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def values(raw: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """Structured garbage: scalars of every type, nested lists and objects, ``raw`` text, a huge list."""
    leaf = st.one_of(SCALARS, raw.map(Raw))
    return st.one_of(
        leaf,
        st.recursive(
            leaf,
            lambda inner: st.one_of(
                st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
            ),
            max_leaves=10,
        ),
        st.integers(min_value=1000, max_value=200_000).map(lambda n: ["user"] * n),
    )
