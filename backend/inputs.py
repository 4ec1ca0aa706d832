"""Reading text that comes from outside specchat (settings.json, ``--prompts`` lines, history rows, models.yaml
values): JSON parsed with bounded size, depth and numbers, and short reprs of values for error messages.

Contract:

- :func:`parse_json` returns the value of one JSON document or raises :class:`InputError` (a ``ValueError``)
  whose ``reason`` says in words what is wrong and whose ``line`` / ``column`` (1-based, None when unknown) say
  where. It refuses text over ``max_chars``, nesting deeper than ``max_depth`` (so no ``RecursionError``, in any
  thread), integers over :data:`MAX_INT_DIGITS` digits (Python's int-string limit would raise ``ValueError``
  inside the decoder), ``NaN`` / ``Infinity`` and numbers that overflow to infinity (none is a JSON number;
  with ``non_finite=True`` they are returned as floats, for a caller that names the field holding one), and
  whatever ``json`` itself rejects. It never raises anything else. Each caller turns ``InputError`` into its
  own :class:`~specchat.backend.errors.SpecchatError` naming the file, line and field.
- :func:`shown` is the repr of a user-supplied value in a message: at most ~100 characters whatever the value
  (a 200,000-item list, a YAML alias bomb, a 5,000-digit number), with control characters escaped.

A leaf: imports only the standard library.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from typing import Any

MAX_DEPTH = 32  # nesting of arrays and objects; specchat's own files need 3
MAX_INT_DIGITS = 40  # every integer specchat reads fits in 2**128
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*+"?|[\[\]{}]', re.DOTALL)  # linear: never re-scans a string


class InputError(ValueError):
    """Text that is not acceptable JSON: ``reason`` in words, ``line`` and ``column`` 1-based when known."""

    def __init__(self, reason: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(reason if line is None else f"line {line} column {column}: {reason}")
        self.reason, self.line, self.column = reason, line, column


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _where(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def _check_depth(text: str, max_depth: int) -> None:
    if text.count("[") + text.count("{") <= max_depth:
        return  # cannot nest deeper: the common case costs two counts
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > max_depth:
                raise InputError(
                    f"nested deeper than {max_depth} levels of [ ] and {{ }}", *_where(text, match.start())
                )
        elif token in ("]", "}"):
            depth = max(depth - 1, 0)  # unbalanced text: json reports it below


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"a number with {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _float(text: str) -> float:
    if len(text) > 1000:
        raise _Refused(f"a number written with {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {shown(text)} is too large for a float")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _any_float(text: str) -> float:
    if len(text) > 1000:
        raise _Refused(f"a number written with {len(text)} characters")
    return float(text)


def parse_json(text: str, *, max_chars: int, max_depth: int = MAX_DEPTH, non_finite: bool = False) -> Any:
    """The value of the JSON document ``text``; :class:`InputError` for anything the contract refuses."""
    if len(text) > max_chars:
        raise InputError(f"{len(text):,} characters long (at most {max_chars:,})")
    _check_depth(text, max_depth)
    try:
        if non_finite:
            return json.loads(text, parse_int=_int, parse_float=_any_float)
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except _Refused as refused:
        raise InputError(refused.reason) from None
    except json.JSONDecodeError as error:
        raise InputError(error.msg, error.lineno, error.colno) from None
    except (RecursionError, MemoryError, ValueError) as error:  # defence in depth: the checks above prevent these
        raise InputError(f"not readable as JSON ({type(error).__name__})") from None


# Values shown in messages are abbreviated: a YAML alias bomb ("billion laughs") builds a small object graph
# whose full repr would be gigabytes long, and a 200,000-item list would make a 1.5 MB line.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 2, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def shown(value: Any) -> str:
    """A short repr of a user-supplied value (at most ~100 characters), safe on huge or deeply aliased values."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a number of about {int(value.bit_length() * 0.30103) + 1} digits>"  # no int-to-text limit hit
    try:
        text = _REPR.repr(value)
    except (RecursionError, ValueError, TypeError, AttributeError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 120 else text[:100] + "..." + text[-8:]
