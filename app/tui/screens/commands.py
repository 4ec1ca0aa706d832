"""The prompt's slash commands, parsed (the chat screen runs them).

``/edit PATH [PATH...] [request]`` (the request after the paths, on the next lines, or in the next message),
``/file PATH [question]`` (read-only context for the message), ``/undo`` (the last applied edit), ``/drop``,
``/new``, ``/help``; ``//text`` sends ``/text``. Quote a path that holds spaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

COMMANDS_HELP = (
    "/edit PATH..., /file PATH, /undo, /drop, /new, /help (start with // to send a message that begins with /)"
)


def is_command(text: str) -> bool:
    """Whether the prompt's ``text`` is a command (``//`` escapes a message that begins with ``/``)."""
    return text.startswith("/") and not text.startswith("//")


def split_path_argument(text: str) -> tuple[str, str]:
    """``PATH [request]`` -> (path, request). A quoted path may hold spaces; an unquoted argument that names
    an existing file is taken whole (spaces included); otherwise the path ends at the first space."""
    text = text.strip()
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        if end > 0:
            return text[1:end], text[end + 1 :].strip()
    if not text or Path(text).expanduser().exists():
        return text, ""
    path, _, request = text.partition(" ")
    return path, request.strip()


def split_paths(text: str) -> tuple[list[str], str]:
    """``PATH [PATH...] [request]`` -> (paths, request): after the first path, each next word (or quoted
    phrase) that names an existing file is one more path; the rest is the request."""
    path, rest = split_path_argument(text)
    paths = [path] if path else []
    while rest:
        following, after = split_path_argument(rest)
        if not following or not Path(following).expanduser().is_file():
            break
        paths.append(following)
        rest = after
    return paths, rest


@dataclass(frozen=True)
class Command:
    """A parsed command: its name (``/edit``), for ``/edit`` and ``/file`` the paths it names (``/file``: one,
    maybe empty) and the request that follows them (on the first line or the next ones)."""

    name: str
    paths: list[str] = field(default_factory=list)
    request: str = ""


def parse_command(text: str) -> Command:
    first, _, rest = text.partition("\n")
    name, _, argument = first.strip().partition(" ")
    if name not in ("/edit", "/file"):
        return Command(name)
    if name == "/edit":
        paths, inline = split_paths(argument)
    else:
        path, inline = split_path_argument(argument)
        paths = [path]
    return Command(name, paths, "\n".join(part for part in (inline, rest.strip()) if part))
