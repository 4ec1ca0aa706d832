"""Reading a models file: YAML with line numbers kept for error messages, and duplicate keys refused.

Contract: ``read_yaml(file)`` returns the parsed document; every mapping in it is a :class:`_Map` (a dict
with ``.line`` and ``.key_lines``, 1-based). Syntax errors, duplicate keys, unreadable files, files over
:data:`MAX_YAML_BYTES`, nesting deeper than ``inputs.MAX_DEPTH`` (aliases followed), integers over
``inputs.MAX_INT_DIGITS`` digits and impossible dates raise :class:`ConfigError` naming the file and line; nothing
else escapes (no ``RecursionError``, no bare ``ValueError``). YAML merge keys (``<<: *anchor``) are allowed, and
keys written explicitly next to a merge override the merged ones (only repeated explicit keys are errors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from specchat.backend.errors import ConfigError
from specchat.backend.inputs import MAX_DEPTH, MAX_INT_DIGITS, shown

__all__ = ["MAX_YAML_BYTES", "read_yaml", "shown"]
MAX_YAML_BYTES = 4 << 20  # a models file with a thousand pairs is ~300 kB


class _Map(dict):
    """A YAML mapping that remembers its line and the line of each key (1-based), for error messages."""

    line: int = 0
    key_lines: dict


class _DuplicateKey(Exception):
    pass


class _TooDeep(Exception):
    def __init__(self, line: int) -> None:
        self.line = line


class _Loader(yaml.SafeLoader):
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """PyYAML composes by recursion: refuse a document nested too deeply before Python's stack does."""
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


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


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """Integers of at most ~40 digits, in any YAML notation (Python's int-string limit raises a bare ValueError)."""
    if len(str(node.value)) > MAX_INT_DIGITS + 20:
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"the number {shown(node.value)} has {len(str(node.value))} characters (at most {MAX_INT_DIGITS} digits)",
            node.start_mark,
        )
    try:
        return loader.construct_yaml_int(node)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{shown(node.value)} is not an integer", node.start_mark
        ) from None


def _construct_timestamp(loader: _Loader, node: yaml.ScalarNode) -> Any:
    """An unquoted date such as 2001-13-45 matches YAML's date pattern but no calendar day: say so, by line."""
    try:
        return loader.construct_yaml_timestamp(node)
    except (ValueError, OverflowError) as exc:
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"{shown(node.value)} looks like a date but is not one ({exc}); quote it if it is text",
            node.start_mark,
        ) from None


# libyaml's parser and composer (C) where PyYAML has it: faster (`specchat models`, benchmarks/RESULTS.md); it
# refuses nesting past its own limit (1,000) before any recursion, and _too_deep checks ours after composing.
_FastLoader: Any = type("_FastLoader", (yaml.CSafeLoader,), {}) if getattr(yaml, "__with_libyaml__", False) else None
for _loader in (_Loader, _FastLoader):
    if _loader is not None:
        _loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
        _loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
        _loader.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)


def _too_deep(root: yaml.Node, limit: int) -> yaml.Node | None:
    """The first node nested deeper than ``limit`` (aliases followed: a chain of them nests without any
    indentation), or None. Iterative (no recursion, whatever the document); a node is walked again only when
    reached deeper than before, so at most ``limit`` times."""
    depth: dict[int, int] = {}  # id(node) -> the depth it was first reached at
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, level = stack.pop()
        if level > limit:
            return node
        if depth.get(id(node), 0) >= level:
            continue  # already walked at this depth or deeper (a shared alias)
        depth[id(node)] = level
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, level + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend((part, level + 1) for pair in node.value for part in pair)
    return None


def read_yaml(file: Path) -> Any:
    try:
        with open(file, "rb") as handle:
            data = handle.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the file ({exc.strerror or exc}); check the path") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{file}: larger than {MAX_YAML_BYTES >> 20} MiB; a models file is a few kB of text: "
            "check that --models names the right file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text; save the file as UTF-8") from None
    try:
        loader = (_FastLoader or _Loader)(text)
        try:
            node = loader.get_single_node()  # the node graph first: its depth is checked before building values
            deep = None if node is None else _too_deep(node, MAX_DEPTH)
            if deep is not None:
                raise _TooDeep(deep.start_mark.line + 1)
            return None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except _TooDeep as exc:
        raise ConfigError(
            f"{file}:{exc.line}: nested deeper than {MAX_DEPTH} levels (or an alias contains itself); "
            "a models file needs 4 (pairs, a pair, its target, a field): fix the indentation, the "
            "brackets or the aliases"
        ) from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{file}: {exc}; remove or rename one of them") from None
    except (ValueError, OverflowError, TypeError, RecursionError) as exc:  # defence in depth: a value no check saw
        raise ConfigError(
            f"{file}: a value cannot be read ({type(exc).__name__}: {shown(str(exc))}); check the "
            "numbers and dates in the file, or quote them"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and start is not None:  # e.g. an unclosed brace: say where it opened, not only where it ended
            problem += f" ({context} at line {start.line + 1})"
        if isinstance(exc, yaml.constructor.ConstructorError) and not (exc.problem or "").startswith("could not"):
            raise ConfigError(f"{where}: cannot read the value: {problem}") from None
        raise ConfigError(
            f"{where}: YAML syntax error: {problem}; fix the syntax (indentation, quotes, colons, brackets)"
        ) from None
