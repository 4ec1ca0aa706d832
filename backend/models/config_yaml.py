"""Reading a models file: YAML with line numbers kept for error messages, and duplicate keys refused.

Contract: ``read_yaml(file)`` returns the parsed document; every mapping in it is a :class:`_Map` (a dict
with ``.line`` and ``.key_lines``, 1-based). Syntax errors, duplicate keys and unreadable files raise
:class:`ConfigError` naming the file and line. YAML merge keys (``<<: *anchor``) are allowed, and keys written
explicitly next to a merge override the merged ones (only repeated explicit keys are errors).
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml

from specchat.backend.errors import ConfigError


class _Map(dict):
    """A YAML mapping that remembers its line and the line of each key (1-based), for error messages."""

    line: int = 0
    key_lines: dict


class _DuplicateKey(Exception):
    pass


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Map:
    explicit = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
    loader.flatten_mapping(node)  # YAML merge keys (<<: *anchor) let users share a model block
    merged = len(node.value) - explicit  # flatten puts the merged pairs first; explicit keys override them
    result = _Map()
    result.line, result.key_lines = node.start_mark.line + 1, {}
    seen: set = set()
    for index, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise _DuplicateKey(f"line {line}: a mapping key must be a plain scalar, got {shown(key)}")
        if index >= merged:
            if key in seen:
                raise _DuplicateKey(f"line {line}: key {shown(key)} repeats the one on line {result.key_lines[key]}")
            seen.add(key)
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = line
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


# Values shown in messages are abbreviated: a YAML alias bomb ("billion laughs") builds a small object graph
# whose full repr would be gigabytes long.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 2, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def shown(value: Any) -> str:
    """A short repr of a user-supplied value, safe on huge or deeply aliased structures."""
    return _REPR.repr(value)


def read_yaml(file: Path) -> Any:
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the file ({exc.strerror or exc}); check the path") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text; save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(f"{file}: {exc}; remove or rename one of them") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and start is not None:  # e.g. an unclosed brace: say where it opened, not only where it ended
            problem += f" ({context} at line {start.line + 1})"
        raise ConfigError(f"{where}: YAML syntax error: {problem}; fix the syntax (indentation, quotes, colons, "
                          "brackets)") from None
