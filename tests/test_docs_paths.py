"""The docs cannot drift from the tree: every repository path written in backticks in README.md, CONTRIBUTING.md
or docs/*.md names a file or folder that exists.

What counts as a path: one inline code span, outside fenced blocks, with no space, that contains a ``/`` or ends
in one of PATH_SUFFIXES. Not paths: commands and code (spaces, ``=``, ``(``, quotes), URLs and ``hf:`` sources
(``:``), user paths (``~/...``), routes and slash commands (a leading ``/``), globs (``*``, ``?``, ``[``) and
placeholders (``<x>``, ``{x}``, a segment in capitals such as ``NAME``). ``qweight.cpp/.h`` names two files.

Where a path may be: relative to the repository root, or under some folder of the repository (a doc's table of
``app/chat/`` names ``history/`` and ``edit_files.py``); so ``history/`` is found when any ``.../history/`` is,
a bare ``edit_files.py`` when any file has that name. The repository's files are git's (tracked and untracked
but not ignored), so an ignored output folder a working copy happens to hold does not count.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH_SUFFIXES = (".py", ".md", ".cpp", ".h", ".yaml", ".yml", ".toml", ".sh", ".tcss", ".cfg", ".in", ".jsonl")
NOT_A_PATH = re.compile(r"[\s=(),'\"*?\[\]{}<>:$@]|^~|^/|^-|://")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # NAME, ORG: a word the reader fills in
SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^\s*(```|~~~)")


@functools.cache
def repository_paths() -> tuple[frozenset[str], frozenset[str]]:
    """(files, folders) relative to ROOT, as posix strings."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):  # an unpacked sdist: no git, nothing ignored to leave out
        listed = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(ROOT).parts)
        ]
    files = {f for f in listed if (ROOT / f).exists()}  # deleted but not yet committed: gone
    folders = {str(Path(f).parent.as_posix()) for f in files}
    for folder in list(folders):
        while folder not in ("", "."):
            folders.add(folder)
            folder = str(Path(folder).parent.as_posix())
    return frozenset(files), frozenset(folders)


def candidates(span: str) -> list[str]:
    """The repository paths one code span names (none for code, commands, URLs and placeholders)."""
    text = span.strip()
    if not text or NOT_A_PATH.search(text):
        return []
    names = [text]
    two = re.fullmatch(r"([\w./-]+?)(\.\w+)/(\.\w+)", text)  # qweight.cpp/.h
    if two:
        names = [two.group(1) + two.group(2), two.group(1) + two.group(3)]
    found = []
    for name in names:
        if name.startswith("./"):
            name = name[2:]
        segments = [s for s in name.rstrip("/").split("/") if s]
        if not segments or any(PLACEHOLDER.match(s) for s in segments):
            continue
        if "/" in name or name.endswith(PATH_SUFFIXES):
            found.append(name)
    return found


def exists(name: str, files: frozenset[str], folders: frozenset[str]) -> bool:
    if name.endswith("/"):
        stem = name.rstrip("/")
        return stem in folders or any(f.endswith("/" + stem) for f in folders)
    if name in files or name in folders or (ROOT / name).exists():
        return True
    return any(p.endswith("/" + name) for p in files | folders)


def doc_paths(doc: Path) -> list[tuple[int, str]]:
    """(line number, path) for every path-like code span of the doc, fenced blocks left out."""
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for match in SPAN.finditer(line):
            out.extend((number, name) for name in candidates(match.group(2)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    assert doc.exists(), f"{doc.relative_to(ROOT)} is missing: DOCS lists it"
    files, folders = repository_paths()
    missing = [(n, name) for n, name in doc_paths(doc) if not exists(name, files, folders)]
    where = doc.relative_to(ROOT).as_posix()
    assert not missing, "paths in backticks that do not exist (fix the doc, or the path if it moved):\n" + "\n".join(
        f"  {where}:{n}: `{name}`" for n, name in missing
    )


@pytest.mark.parametrize(
    ("span", "paths"),
    [
        ("backend/engine/runner.py", ["backend/engine/runner.py"]),
        ("app/chat/", ["app/chat/"]),
        ("edit_files.py", ["edit_files.py"]),
        ("qweight.cpp/.h", ["qweight.cpp", "qweight.h"]),
        ("specchat bench --json", []),  # a command
        ("https://example.com/a.py", []),  # a URL
        ("hf:ORG/NAME/FILE.gguf", []),  # a source with placeholders
        ("~/.cache/specchat", []),  # a user path
        ("/v1/models", []),  # a route
        ("csrc/*.cpp", []),  # a glob
        ("<pair>/config.yaml", []),  # a placeholder
        ("models/NAME/config.yaml", []),
        ("math.exp", []),  # a Python name
        ("engine.generate", []),
        ("bench.json", []),  # an output file, not a source
    ],
)
def test_what_counts_as_a_path(span: str, paths: list[str]) -> None:
    assert candidates(span) == paths


def test_a_missing_path_is_reported_with_its_doc_and_line(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("See `tests/conftest.py`.\n\n```\n`not/checked.py`\n```\nAnd `backend/gone.py`.\n")
    files, folders = repository_paths()
    found = doc_paths(doc)
    assert found == [(1, "tests/conftest.py"), (6, "backend/gone.py")]
    assert [(n, name) for n, name in found if not exists(name, files, folders)] == [(6, "backend/gone.py")]
