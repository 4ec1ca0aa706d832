"""From an ``/edit`` reply to the new content of each attached file, or a refusal saying why: in memory only.

Contract:
- :func:`parse_blocks` reads SEARCH/REPLACE blocks (the format ``editing.build_edit_prompt`` asks for, learnt
  from aider's "diff" edit format): the file's name on a line before ``<<<<<<< SEARCH``, the lines to find, a
  ``=======`` line, the lines that replace them, ``>>>>>>> REPLACE``; fences around them are ignored. A block
  cut short (no divider, or the reply ended inside it) is a problem, never a block. It never raises.
- :func:`plan_edit` never raises either, and never writes. Its :class:`EditPlan` holds either the changed files
  (``changes``) or the reasons nothing may be written (``refusals``), never both:
  - a reply with SEARCH/REPLACE blocks: each block is applied exactly, in order, to its file's text as left by
    the blocks before it. Its SEARCH lines must occur once, whole lines, character for character; a block
    whose SEARCH text is missing, empty, or found at several places is refused with the reason (the closest
    line of the file, when there is one). One refused block refuses the whole edit: half an edit can leave
    code that no longer fits together.
  - a reply without blocks is taken as the whole new file (its largest fenced block; with several files,
    each block needs the file's name on the line before it), and is refused when it is cut short (the reply
    ended inside the block), or when it drops definitions (functions, classes, methods, top-level names)
    that the request does not ask to remove (by name, with a verb such as remove, rename or merge) — what a
    reply holding only the changed part looks like — or, for a file
    without definitions, when it keeps under half the lines of a file of 10 or more that the request did
    not ask to shorten. The message lists what it dropped.
- Texts are ``\\n``-ended, as ``EditTarget.text``; a file without a final newline keeps that.
  :func:`unified_diff` is what the dialog shows (``a/`` + the path as typed, without a leading ``/``).
"""

from __future__ import annotations

import ast
import difflib
import re
from collections import Counter
from dataclasses import dataclass

from specchat.app.chat.editing import EditTarget, code_blocks

_SEARCH = re.compile(r"^\s*<{5,9}\s*SEARCH\s*$")
_DIVIDER = re.compile(r"^\s*={5,9}\s*$")
_REPLACE = re.compile(r"^\s*>{5,9}\s*REPLACE\s*$")
_FENCE_LINE = re.compile(r"^\s*(`{3,}|~{3,})")
_SHRINK_WORDS = re.compile(r"\b(delete|remove|drop|shorten|trim|strip|clear|empty|truncate|cut|only)", re.I)
_DROP_WORDS = re.compile(r"\b(delete|remove|drop|rename|merge|replace|move|inline|combine|split|get rid)", re.I)
_DEFINITION_PATTERNS = [
    re.compile(p, re.M)
    for p in (
        r"^[ \t]*(?:export\s+)?(?:default\s+)?(?:async\s+)?function\*?\s+([A-Za-z_$][\w$]*)",  # JavaScript
        r"^[ \t]*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+(\w+)",  # Rust
        r"^func\s+(?:\([^)]*\)\s*)?(\w+)",  # Go
        r"^[ \t]*(?:export\s+)?(?:public\s+|private\s+|protected\s+|internal\s+)?(?:abstract\s+|final\s+|static\s+)*"
        r"(?:class|struct|enum|interface|trait|module|object|record)\s+(\w+)",
        r"^[ \t]*(?:def|defp|defmodule|sub|proc)\s+([\w.?!]+)",  # Ruby, Elixir, Perl, Tcl
        r"^[ \t]*(?:export\s+)?(?:const|let|var)\s+([A-Za-z_$][\w$]*)\s*=\s*(?:async\s*)?(?:function\b|\([^)]*\)\s*=>)",
    )
]


@dataclass(frozen=True, slots=True)
class EditBlock:
    number: int  # 1-based, in the order of the reply
    file: str  # the file name written before the block ("" when none)
    search: str  # every line "\n"-ended ("" when the part is empty)
    replace: str


@dataclass(frozen=True, slots=True)
class FileChange:
    target: EditTarget
    text: str  # the new content, "\n" line ends
    how: str  # "SEARCH/REPLACE blocks" or "whole file"
    notes: tuple[str, ...] = ()  # warnings the dialog shows (it does not parse, ...)


@dataclass(frozen=True, slots=True)
class EditPlan:
    changes: tuple[FileChange, ...] = ()
    refusals: tuple[str, ...] = ()  # non-empty: nothing may be written

    @property
    def ok(self) -> bool:
        return bool(self.changes) and not self.refusals

    def message(self) -> str:
        """The refusal as one notification: every reason, then that nothing was written."""
        return " ".join(self.refusals) + " Nothing was written."


def split_lines(text: str) -> list[str]:
    """``text`` in lines that keep their ``\\n`` (only ``\\n`` splits: form feeds and lone CRs stay inside)."""
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]]
    return out + [lines[-1]] if lines[-1] else out


# -- parsing --------------------------------------------------------------------------------------------------
def _file_name(line: str) -> str:
    """A file name written on its own line (decorations removed), or ""."""
    name = line.strip()
    name = re.sub(r"^(?:#+|\*+|[-+] )\s*", "", name)
    name = re.sub(r"^(?:file(?:name)?|path)\s*:\s*", "", name, flags=re.I)
    name = name.strip("*`'\"").rstrip(":").strip("*`'\" ")
    if not name or any(c.isspace() for c in name) or not re.search(r"[./\\]", name) or name.endswith("."):
        return ""
    return name


def _name_before(lines: list[str], index: int) -> str | None:
    """The file name in the three lines before ``index`` (skipping fences and blank lines); None when none."""
    for line in reversed(lines[max(0, index - 3) : index]):
        if not line.strip() or _FENCE_LINE.match(line):
            continue
        if _REPLACE.match(line) or _DIVIDER.match(line):
            return None
        return _file_name(line) or None
    return None


def parse_blocks(reply: str) -> tuple[list[EditBlock], list[str]]:
    """The reply's SEARCH/REPLACE blocks, and a problem for each block cut short (see the module docstring)."""
    lines = reply.replace("\r\n", "\n").split("\n")
    blocks: list[EditBlock] = []
    problems: list[str] = []
    current = ""
    i = 0
    while i < len(lines):
        if not _SEARCH.match(lines[i]):
            i += 1
            continue
        number = len(blocks) + len(problems) + 1
        current = _name_before(lines, i) or current
        parts: list[list[str]] = [[], []]
        part, j = 0, i + 1
        while j < len(lines):
            line = lines[j]
            if _SEARCH.match(line) or (part == 1 and _DIVIDER.match(line)):
                break
            if part == 0 and _DIVIDER.match(line):
                part = 1
            elif part == 1 and _REPLACE.match(line):
                break
            else:
                parts[part].append(line)
            j += 1
        ended = j < len(lines) and part == 1 and _REPLACE.match(lines[j]) is not None
        if ended:
            search, replace = ("".join(f"{line}\n" for line in p) for p in parts)
            blocks.append(EditBlock(number, current, search, replace))
            i = j + 1
            continue
        missing = "=======" if part == 0 else ">>>>>>> REPLACE"
        where = "the reply ended inside it" if j >= len(lines) else "another marker came first"
        problems.append(f"Block {number} is incomplete: no `{missing}` line ({where}).")
        i = j if j > i else i + 1
    return blocks, problems


# -- applying blocks -------------------------------------------------------------------------------------------
def _target_for(name: str, targets: list[EditTarget]) -> EditTarget | None:
    if not name:
        return targets[0] if len(targets) == 1 else None
    wanted = name.replace("\\", "/").removeprefix("./")
    for target in targets:
        forms = {target.shown, str(target.path), target.path.name, target.link}
        if name in forms or wanted in forms or target.path.as_posix().endswith("/" + wanted):
            return target
    return None


def _short(line: str, width: int = 60) -> str:
    line = line.rstrip("\n").strip()
    return line if len(line) <= width else line[: width - 1] + "…"


def _why_not_found(search: str, text: str, name: str) -> str:
    """Which SEARCH line is not in the file, and the closest line of the file (as aider's "did you mean")."""
    file_lines = [line.rstrip("\n") for line in split_lines(text)]
    present = set(file_lines)
    squashed = {" ".join(line.split()): n for n, line in reversed(list(enumerate(file_lines, 1)))}
    for k, line in enumerate(search.rstrip("\n").split("\n"), 1):
        if line in present or not line.strip():
            continue
        if " ".join(line.split()) in squashed:
            return (
                f"its line {k} `{_short(line)}` differs from line {squashed[' '.join(line.split())]} of {name} "
                "in spaces or indentation only"
            )
        close = difflib.get_close_matches(line, list(present), n=1, cutoff=0.6)
        hint = f"; the closest is line {file_lines.index(close[0]) + 1}: `{_short(close[0])}`" if close else ""
        return f"its line {k} `{_short(line)}` is not in {name}{hint}"
    return f"its lines are all in {name}, but not together in this order"


def _occurrences(text: str, search: str) -> list[int]:
    """Offsets where ``search`` starts at the start of a line of ``text``."""
    found, start = [], 0
    while (at := text.find(search, start)) >= 0:
        if at == 0 or text[at - 1] == "\n":
            found.append(at)
        start = at + 1
    return found


def apply_block(text: str, block: EditBlock, name: str) -> tuple[str | None, str]:
    """(the new text, "") or (None, why the block is refused)."""
    label = f"Block {block.number} ({name})"
    if not block.search.strip():
        return None, (
            f"{label} has an empty SEARCH part; to add lines, SEARCH for the lines next to them and "
            "REPLACE them with those lines plus the new ones."
        )
    hay = text if text.endswith("\n") or not text else text + "\n"
    found = _occurrences(hay, block.search)
    if not found:
        why = _why_not_found(block.search, hay, name)
        return None, f"{label} was refused: its SEARCH text is not in the file: {why}."
    if len(found) > 1:
        numbers = ", ".join(str(hay.count("\n", 0, at) + 1) for at in found[:5])
        return None, (
            f"{label} was refused: its SEARCH text matches {len(found)} places (lines {numbers}); "
            "it must match one, with a few more lines around the change."
        )
    at = found[0]
    new = hay[:at] + block.replace + hay[at + len(block.search) :]
    if hay is not text and new.endswith("\n"):
        new = new[:-1]  # the file had no final newline: keep it so
    return new, ""


def _plan_blocks(targets: list[EditTarget], blocks: list[EditBlock], problems: list[str]) -> EditPlan:
    refusals = list(problems)
    texts = {t.path: t.text for t in targets}
    for block in blocks:
        target = _target_for(block.file, targets)
        if target is None:
            attached = ", ".join(t.shown for t in targets)
            refusals.append(
                f"Block {block.number} is for `{block.file}`, which is not attached (attached: {attached})."
                if block.file
                else f"Block {block.number} does not name its file (attached: {attached})."
            )
            continue
        new, why = apply_block(texts[target.path], block, target.path.name)
        if new is None:
            refusals.append(why)
        else:
            texts[target.path] = new
    if refusals:
        return EditPlan(refusals=tuple(refusals))
    changes = tuple(
        FileChange(t, texts[t.path], "SEARCH/REPLACE blocks", _syntax_notes(t, texts[t.path]))
        for t in targets
        if texts[t.path] != t.text
    )
    if not changes:
        return EditPlan(refusals=("The blocks change nothing: their REPLACE parts equal their SEARCH parts.",))
    return EditPlan(changes=changes)


# -- whole-file replies ------------------------------------------------------------------------------------------
def definitions(text: str, language: str) -> set[str]:
    """Names a file defines: for Python (when it parses) functions, classes and methods as ``Class.method``,
    and top-level assigned names; for other text, what common definition keywords introduce."""
    if language == "python":
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None:
            names: set[str] = set()

            def visit(body: list[ast.stmt], prefix: str) -> None:
                for node in body:
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(prefix + node.name)
                        if isinstance(node, ast.ClassDef):
                            visit(node.body, f"{prefix}{node.name}.")
                    elif not prefix and isinstance(node, (ast.Assign, ast.AnnAssign)):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))

            visit(tree.body, "")
            return names
    return {m.group(1) for pattern in _DEFINITION_PATTERNS for m in pattern.finditer(text)}


def _may_drop(name: str, request: str) -> bool:
    """The request names ``name`` and asks to remove, rename, merge, move ... something ("add type hints to
    sub" names the verb "add", not the function ``add``)."""
    named = re.search(rf"(?<![\w$]){re.escape(name.rsplit('.', 1)[-1])}(?![\w$])", request, re.I) is not None
    return named and _DROP_WORDS.search(request) is not None


def _syntax_notes(target: EditTarget, new_text: str) -> tuple[str, ...]:
    if target.language != "python":
        return ()
    try:
        ast.parse(target.text)
    except (SyntaxError, ValueError):
        return ()  # it did not parse before either
    try:
        ast.parse(new_text)
    except SyntaxError as error:
        return (f"The new {target.path.name} does not parse as Python (line {error.lineno}: {error.msg}).",)
    except ValueError as error:
        return (f"The new {target.path.name} does not parse as Python ({error}).",)
    return ()


def guard_whole_file(target: EditTarget, new_text: str, request: str) -> str:
    """Why a whole-file reply may not replace ``target`` ("" when it may)."""
    name = target.path.name
    before = definitions(target.text, target.language)
    dropped = sorted(n for n in before - definitions(new_text, target.language) if not _may_drop(n, request))
    if dropped:
        shown = ", ".join(dropped[:8]) + (f" and {len(dropped) - 8} more" if len(dropped) > 8 else "")
        return (
            f"The reply would replace {name} with a text that drops {shown}, which the request does not ask to "
            "remove: it looks like only the changed part, not the whole file. Ask again for SEARCH/REPLACE "
            "blocks, or say in the request what to remove."
        )
    if before:
        return ""
    old = Counter(line.strip() for line in target.text.split("\n") if line.strip())
    kept = sum((old & Counter(line.strip() for line in new_text.split("\n") if line.strip())).values())
    total = sum(old.values())
    if total >= 10 and kept * 2 < total and not _SHRINK_WORDS.search(request):
        return (
            f"The reply would keep only {kept} of the {total} lines of {name}, and the request does not ask "
            "to shorten it: it looks like only the changed part. Ask again for SEARCH/REPLACE blocks."
        )
    return ""


def _plan_whole(targets: list[EditTarget], reply: str, request: str) -> EditPlan:
    blocks = code_blocks(reply)
    lines = reply.replace("\r\n", "\n").split("\n")
    chosen: dict[int, tuple[EditTarget, str, bool]] = {}
    if len(targets) == 1:
        target = targets[0]
        tagged = [b for b in blocks if b.language.lower() == target.language] or blocks
        if tagged:
            best = max(reversed(tagged), key=lambda b: len(b.text))
            chosen[0] = (target, best.text, best.closed)
    else:
        for block in blocks:
            named = _target_for(_name_before(lines, block.line) or "", targets) if block.line >= 0 else None
            if named is not None:
                chosen[targets.index(named)] = (named, block.text, block.closed)
    if not chosen:
        attached = ", ".join(t.shown for t in targets)
        if len(targets) > 1 and blocks:
            return EditPlan(refusals=(f"The reply's code blocks do not name their files (attached: {attached}).",))
        return EditPlan(refusals=(f"The reply has neither SEARCH/REPLACE blocks nor a code block for {attached}.",))
    refusals: list[str] = []
    changes: list[FileChange] = []
    for _, (target, text, closed) in sorted(chosen.items()):
        if target.text and not target.text.endswith("\n") and text.endswith("\n"):
            text = text[:-1]  # a fenced block always ends its last line; keep the file's own convention
        if not closed:
            refusals.append(
                f"The reply ended inside its code block for {target.path.name} (it was stopped or hit "
                "the token limit), so it is not the whole file."
            )
        elif why := guard_whole_file(target, text, request):
            refusals.append(why)
        elif text != target.text:
            changes.append(FileChange(target, text, "whole file", _syntax_notes(target, text)))
    if refusals:
        return EditPlan(refusals=tuple(refusals))
    if not changes:
        return EditPlan(refusals=("The reply's code is the same as the file: there is nothing to apply.",))
    return EditPlan(changes=tuple(changes))


def plan_edit(targets: list[EditTarget], reply: str, request: str = "") -> EditPlan:
    """What ``reply`` would do to ``targets`` (see the module docstring); never raises, never writes."""
    if not targets:
        return EditPlan(refusals=("No file is attached to this edit.",))
    try:
        blocks, problems = parse_blocks(reply)
        if blocks or problems:
            return _plan_blocks(targets, blocks, problems)
        return _plan_whole(targets, reply, request)
    except RecursionError:  # ast on a pathologically nested reply
        return EditPlan(refusals=("The reply is too deeply nested to check.",))


# -- showing it ------------------------------------------------------------------------------------------------
def diff_name(target: EditTarget) -> str:
    """The path in a diff header after ``a/`` and ``b/``: as typed, without a leading ``/``."""
    return target.shown.lstrip("/") or target.path.name


def unified_diff(target: EditTarget, new_text: str) -> str:
    """A unified diff from the loaded file to ``new_text`` ("" when identical)."""
    old_lines, new_lines = split_lines(target.text), split_lines(new_text.replace("\r\n", "\n"))
    name = diff_name(target)
    out = []
    for line in difflib.unified_diff(old_lines, new_lines, f"a/{name}", f"b/{name}"):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)
