"""Which attached file a block of an ``/edit`` reply is for: the name written before it, matched against the files
by path, never guessed.

Contract: :func:`name_before` reads the file name a reply writes on the line before a block (decorations such as
``###``, ``**``, backticks, ``File:`` removed); a name may hold spaces (``my file.py``) when it ends in an
extension and has at most four words, otherwise a line with spaces is prose and names nothing.
:func:`target_for` is the one attached file a name means: the file it names exactly (as typed, its real path,
or the link it was attached through), else the only one whose path ends with it; None when it means none or
several, and then :func:`ambiguity` says which files it could be (two attached ``util.py`` in different folders
need ``a/util.py``). Nothing here reads the disk.
"""

from __future__ import annotations

import re

from specchat.app.chat.editing import EditTarget

_FENCE_LINE = re.compile(r"^\s*(`{3,}|~{3,})")
_DIVIDER = re.compile(r"^\s*={5,9}\s*$")
_REPLACE = re.compile(r"^\s*>{5,9}\s*REPLACE\s*$")
_SPACED_NAME = re.compile(r"[^\s:;,!?]\.[A-Za-z0-9_+-]{1,12}$")  # "my file.py": a name with spaces ends in .ext


def file_name(line: str) -> str:
    """A file name written on its own line (decorations removed), or "". A name with spaces (``my file.py``) is
    taken when it ends in an extension and is short; other lines with spaces are prose."""
    name = line.strip()
    name = re.sub(r"^(?:#+|\*+|[-+] )\s*", "", name)
    name = re.sub(r"^(?:file(?:name)?|path)\s*:\s*", "", name, flags=re.I)
    name = name.strip("*`'\"").rstrip(":").strip("*`'\" ")
    if not name or not re.search(r"[./\\]", name) or name.endswith("."):
        return ""
    if any(c.isspace() for c in name) and (len(name.split()) > 4 or not _SPACED_NAME.search(name)):
        return ""
    return name


def name_before(lines: list[str], index: int) -> str | None:
    """The file name in the three lines before ``index`` (skipping fences and blank lines); None when none."""
    for line in reversed(lines[max(0, index - 3) : index]):
        if not line.strip() or _FENCE_LINE.match(line):
            continue
        if _REPLACE.match(line) or _DIVIDER.match(line):
            return None
        return file_name(line) or None
    return None


def _posix(text: str) -> str:
    return text.replace("\\", "/").removeprefix("./")


def _matches(name: str, targets: list[EditTarget]) -> list[EditTarget]:
    """The attached files ``name`` may mean: the one it names exactly (as typed, real path or link), else every
    one whose real path or link ends with it (``util.py`` matches both ``a/util.py`` and ``b/util.py``)."""
    if not name:
        return targets[:1] if len(targets) == 1 else []
    wanted = _posix(name)
    exact = [t for t in targets if wanted in {_posix(t.shown), t.path.as_posix(), _posix(t.link)}]
    if exact:
        return exact
    return [
        t
        for t in targets
        if t.path.as_posix().endswith("/" + wanted) or (t.link and _posix(t.link).endswith("/" + wanted))
    ]


def target_for(name: str, targets: list[EditTarget]) -> EditTarget | None:
    """The one attached file ``name`` means, None when it means none or several (:func:`ambiguity` says)."""
    found = _matches(name, targets)
    return found[0] if len(found) == 1 else None


def ambiguity(what: str, name: str, targets: list[EditTarget]) -> str | None:
    found = _matches(name, targets)
    if len(found) < 2:
        return None
    return (
        f"{what} names `{name}`, which could be any of {', '.join(t.shown for t in found)}: nothing was "
        "guessed. Ask again, naming each file by its path."
    )
