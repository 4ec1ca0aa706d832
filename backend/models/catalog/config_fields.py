"""Reading one field of a models file: presence, type and range checks whose errors name the file, line, pair,
field, value and what to do (``config.py`` and ``model_spec.py`` read every field through these).

Contract: :class:`Where` carries the error context (file, pair, the mapping being read, a field prefix such as
``target.``); :func:`take`, :func:`bounded_int`, :func:`choice` and :func:`reject_unknown` raise
:class:`~specchat.backend.errors.ConfigError` from :meth:`Where.error`. ``bool`` is never accepted as a number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specchat.backend.errors import ConfigError
from specchat.backend.models.catalog.config_yaml import _Map, shown


class Where:
    """Error context: the file, the pair (when known) and the mapping being read."""

    def __init__(self, file: Path, pair: str | None = None, node: dict[str, Any] | None = None, prefix: str = ""):
        self.file, self.pair, self.node, self.prefix = file, pair, node, prefix

    def error(self, key: str, value: Any, problem: str, fix: str) -> ConfigError:
        line = None
        if isinstance(self.node, _Map):
            line = self.node.key_lines.get(key, self.node.line) or None
        where = f"{self.file}:{line}" if line else f"{self.file}"
        pair = f" pair '{self.pair}':" if self.pair else ""
        text = "(missing)" if value is MISSING else shown(value)
        return ConfigError(f"{where}:{pair} field '{self.prefix}{key}' = {text}: {problem}; {fix}")


MISSING = object()


def take(where: Where, key: str, types: tuple[type, ...], fix: str, default: Any = MISSING) -> Any:
    """Read one field, checking presence and type (bool is never accepted as a number)."""
    node = where.node or {}
    value = node.get(key, MISSING)
    if value is MISSING:
        if default is not MISSING:
            return default
        raise where.error(key, MISSING, "this field is required", f"add it ({fix})")
    numeric = any(t in (int, float) for t in types)
    if not isinstance(value, types) or (numeric and isinstance(value, bool) and bool not in types):
        expected = " or ".join(t.__name__ for t in types)
        raise where.error(key, value, f"expected {expected} ({fix}), got {type(value).__name__}", "fix the value")
    return value


def bounded_int(where: Where, key: str, low: int, high: int | None, fix: str, default: Any = MISSING) -> Any:
    """The integer field ``key`` within [low, high]; ``default`` (None included) when the field is left out."""
    value = take(where, key, (int,), fix, default)
    if value is None:  # an optional field left out (default None)
        return None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise where.error(key, value, f"must be {bound} ({fix})", "fix the value")
    return value


def choice(where: Where, key: str, choices: tuple[str, ...], default: Any = MISSING) -> str:
    fix = "use one of " + ", ".join(choices)
    value = take(where, key, (str,), fix, default)
    if value not in choices:
        raise where.error(key, value, "not a known value", fix)
    return value


def reject_unknown(where: Where, allowed: set[str]) -> None:
    for key in where.node or {}:
        if key not in allowed:
            name = str(key) if str(key).isprintable() else shown(str(key))[1:-1]  # a newline in a key: escaped
            raise where.error(
                name,
                (where.node or {})[key],
                "unknown field",
                "remove it or fix its name; allowed fields: " + ", ".join(sorted(allowed)),
            )
