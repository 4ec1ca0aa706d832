"""`/edit PATH...` and `/file PATH`: attach local text files and build the prompts that ask for changes.

Contract:
- :func:`load_edit_target` reads a UTF-8 text file of at most ``MAX_FILE_BYTES`` (256 KiB) and remembers its
  bytes' SHA-256 and mtime; every refusal (a NUL byte in the path, missing, a folder, not a regular file, too
  big, unreadable, binary, not UTF-8) raises :class:`EditError` naming the path and what to do.
  :func:`check_writable` says before the model runs whether the file could be saved. ``/file``
  (:func:`build_file_context`) validates the same way.
- A symlink is resolved when loaded: ``EditTarget.path`` is the real file (the only one an edit writes), and
  ``EditTarget.link`` the path as given when it differs, so every dialog can name both.
- Text is handled with ``\\n`` line ends (``EditTarget.text``); the file's own line ends, mixed ones included,
  stay in ``EditTarget.original`` and are put back line by line when writing (``edit_files.py``).
- :func:`build_edit_prompt` asks for the whole changed file for one file of at most ``REWRITE_MAX_BYTES``
  (:func:`rewrites_whole`), and the reply is drafted from the file itself (:func:`edit_prediction`, the
  request's ``prediction``: the reply is mostly the file copied, at many tokens per pass); else for
  SEARCH/REPLACE blocks (the format of aider's "diff" edit format): each block copies the lines it changes,
  which prompt lookup drafts well. ``edit_plan.py`` parses either reply (a whole file is checked to keep every
  definition) and applies it exactly; ``edit_files.py`` writes the result.
- :func:`extract_code_block` takes the reply's largest fenced block (``` or ~~~, any info string, an unclosed
  block at the end of a partial reply included); it never raises on any text.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from specchat.backend.errors import SpecchatError

MAX_FILE_BYTES = 256 * 1024
# The largest file /edit asks to rewrite whole (its text as prediction), else SEARCH/REPLACE blocks. Rule: the whole
# file must fit the reply /edit asks for (the chat's max_new_tokens, 1,024 by default) with room for the fences and
# a changed line or two, and finish in seconds on a 2-core CPU: a 4 KiB file is already more tokens than the cap,
# and time grows faster than the file (benchmarks/RESULTS.md, "/edit's whole rewrite against SEARCH/REPLACE blocks
# by file size"; benchmarks/rewrite_size.py).
REWRITE_MAX_BYTES = 3 * 1024

_LANGUAGES = {
    ".py": "python",
    ".pyi": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".cjs": "javascript",
    ".ts": "typescript",
    ".tsx": "tsx",
    ".jsx": "jsx",
    ".rs": "rust",
    ".go": "go",
    ".c": "c",
    ".h": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".cxx": "cpp",
    ".hpp": "cpp",
    ".hh": "cpp",
    ".java": "java",
    ".kt": "kotlin",
    ".swift": "swift",
    ".cs": "csharp",
    ".rb": "ruby",
    ".php": "php",
    ".lua": "lua",
    ".pl": "perl",
    ".r": "r",
    ".jl": "julia",
    ".hs": "haskell",
    ".ml": "ocaml",
    ".ex": "elixir",
    ".exs": "elixir",
    ".erl": "erlang",
    ".scala": "scala",
    ".dart": "dart",
    ".zig": "zig",
    ".sh": "bash",
    ".bash": "bash",
    ".zsh": "zsh",
    ".fish": "fish",
    ".ps1": "powershell",
    ".sql": "sql",
    ".html": "html",
    ".htm": "html",
    ".css": "css",
    ".tcss": "css",
    ".scss": "scss",
    ".xml": "xml",
    ".json": "json",
    ".yaml": "yaml",
    ".yml": "yaml",
    ".toml": "toml",
    ".ini": "ini",
    ".cfg": "ini",
    ".md": "markdown",
    ".rst": "rst",
    ".tex": "latex",
    ".vue": "vue",
    ".svelte": "svelte",
    ".txt": "text",
}
_NAMED_LANGUAGES = {"makefile": "make", "dockerfile": "dockerfile", "cmakelists.txt": "cmake"}

# An opening fence: up to 3 spaces, 3+ backticks or tildes, then the info string (no backtick for ``` fences).
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


class EditError(SpecchatError):
    """A file cannot be attached, edited or saved; the message names the path and what to do."""


@dataclass(frozen=True, slots=True)
class EditTarget:
    path: Path  # absolute, symlinks resolved: the only file an edit writes
    text: str  # the content, "\n" line ends
    encoding: str  # "utf-8" or "utf-8-sig" (a BOM to restore)
    mtime: float  # st_mtime when loaded (shown to the user; changes are detected by sha256)
    sha256: str  # of the bytes on disk when loaded
    newline: str = "\n"  # the most common line end ("\r\n" for a CRLF file): the one new lines get
    display: str = ""  # the path as the user typed it, for messages
    original: str = ""  # the decoded content with its own line ends (mixed ones kept)
    link: str = ""  # the absolute path as given, when it is (or goes through) a symlink; "" otherwise

    @property
    def language(self) -> str:
        return language_for(self.path)

    @property
    def shown(self) -> str:
        """The path as the user typed it (the real path when none was kept)."""
        return self.display or str(self.path)

    @property
    def mixed_newlines(self) -> bool:
        """Both CRLF and bare LF line ends: each line keeps its own when the file is written."""
        crlf = self.original.count("\r\n")
        return 0 < crlf < self.original.count("\n")


def language_for(path: Path) -> str:
    """The Markdown fence language tag for a file name ("text" when unknown)."""
    return _NAMED_LANGUAGES.get(path.name.lower()) or _LANGUAGES.get(path.suffix.lower(), "text")


def _size(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MiB" if n >= 1024 * 1024 else f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


def load_edit_target(path: str | os.PathLike[str], *, command: str = "/edit") -> EditTarget:
    """Read and validate a file for ``/edit`` (or ``/file``: pass ``command`` for the messages)."""
    shown = str(path)
    where = f"{command} {shown!r}" if "\0" in shown else f"{command} {shown}"
    if "\0" in shown:
        raise EditError(f"{where}: the path contains a NUL byte, which no file name can hold. Type the path again.")
    given = Path(path).expanduser()
    if not given.is_absolute():
        given = Path.cwd() / given
    try:
        real = given.resolve(strict=True)
        st = real.stat()
    except FileNotFoundError:
        raise EditError(
            f"{where}: no such file ({given}). Check the path; relative paths start from {Path.cwd()}."
        ) from None
    except PermissionError:
        raise EditError(
            f"{where}: permission denied while looking up {given}. Check the permissions of its folders."
        ) from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        reason = getattr(exc, "strerror", None) or exc
        raise EditError(f"{where}: cannot open {given}: {reason}. Check the path.") from None
    if stat.S_ISDIR(st.st_mode):
        raise EditError(f"{where}: {real} is a folder, not a file. Name one file inside it.")
    if not stat.S_ISREG(st.st_mode):
        raise EditError(f"{where}: {real} is not a regular file (a device, pipe or socket). Name a text file.")
    if st.st_size > MAX_FILE_BYTES:
        raise EditError(
            f"{where}: {real} is {_size(st.st_size)} ({st.st_size} bytes); {command} accepts files up to "
            f"{_size(MAX_FILE_BYTES)} because the whole file goes into the prompt. Attach a smaller file or split it."
        )
    try:
        with open(real, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except PermissionError:
        raise EditError(
            f"{where}: cannot read {real}: permission denied. Make it readable (chmod u+r {shown})."
        ) from None
    except OSError as exc:
        raise EditError(f"{where}: cannot read {real}: {exc.strerror or exc}.") from None
    if len(data) > MAX_FILE_BYTES:  # it grew between stat and read
        raise EditError(
            f"{where}: {real} is larger than {_size(MAX_FILE_BYTES)}, the {command} limit. Attach a smaller file."
        )
    if b"\0" in data:
        raise EditError(
            f"{where}: {real} looks like a binary file (it contains NUL bytes); {command} works on text files only."
        )
    encoding = "utf-8-sig" if data.startswith(b"\xef\xbb\xbf") else "utf-8"
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise EditError(
            f"{where}: {real} is not UTF-8 text (invalid byte at offset {exc.start}); {command} works on UTF-8 "
            "text files only. Convert it to UTF-8 or choose another file."
        ) from None
    crlf = text.count("\r\n")
    newline = "\r\n" if crlf and crlf * 2 >= text.count("\n") else "\n"
    return EditTarget(
        path=real,
        text=text.replace("\r\n", "\n"),
        encoding=encoding,
        mtime=st.st_mtime,
        sha256=hashlib.sha256(data).hexdigest(),
        newline=newline,
        display=shown,
        original=text,
        link=str(given) if os.path.abspath(given) != str(real) else "",
    )


def check_writable(target: EditTarget) -> None:
    """Raise EditError now (before the model runs) if saving the edit would fail: file or folder not writable."""
    shown, folder = target.display or target.path, target.path.parent
    effective = os.access in os.supports_effective_ids
    if not os.access(target.path, os.W_OK, effective_ids=effective):
        raise EditError(
            f"/edit {shown}: {target.path} is read-only for you, so an edit could not be saved. Make it writable "
            f"(chmod u+w {target.path}), or copy it somewhere you can write and /edit the copy."
        )
    if not os.access(folder, os.W_OK | os.X_OK, effective_ids=effective):
        raise EditError(
            f"/edit {shown}: its folder {folder} is not writable, and specchat saves the new version and a backup "
            "next to the file. Make the folder writable, or copy the file elsewhere and /edit the copy."
        )


def _fence_for(text: str) -> str:
    """A backtick fence longer than any backtick run in ``text``, so the file cannot close it early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


SEARCH, DIVIDER, REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"


def rewrites_whole(targets: list[EditTarget]) -> bool:
    """Whether /edit asks for the whole changed file (one file of at most REWRITE_MAX_BYTES) rather than blocks."""
    return len(targets) == 1 and len(targets[0].text.encode("utf-8")) <= REWRITE_MAX_BYTES


def edit_prediction(targets: list[EditTarget]) -> str | None:
    """The reply a whole-file /edit is predicted to be (the file in its fence, as the prompt shows it), drafted
    from by the engine; None when /edit asks for blocks."""
    if not rewrites_whole(targets):
        return None
    target = targets[0]
    fence = _fence_for(target.text)
    body = target.text if target.text.endswith("\n") or not target.text else target.text + "\n"
    return f"{fence}{target.language}\n{body}{fence}"


def build_edit_prompt(targets: EditTarget | list[EditTarget], request: str) -> str:
    """The user message for ``/edit PATH... request``: how to answer (the whole file, or SEARCH/REPLACE blocks:
    :func:`rewrites_whole`), the request, then each whole file in a fenced block."""
    targets = [targets] if isinstance(targets, EditTarget) else list(targets)
    if not targets:
        raise EditError("/edit: attach a file first, e.g. /edit src/main.py add type hints")
    if not request.strip():
        shown = targets[0].shown
        raise EditError(f"/edit {shown}: say what to change after the path, e.g. /edit {shown} add type hints")
    labels = edit_labels(targets)
    first = targets[0]
    if rewrites_whole(targets):
        fence, lang = _fence_for(first.text), first.language
        body = first.text if first.text.endswith("\n") or not first.text else first.text + "\n"
        return (
            f"Edit `{first.path.name}` as requested. Answer with the whole new file in one {lang} code block: "
            "every line of it, changed or not, copied character for character where nothing changes. Change "
            f"nothing the request does not ask for. Explain after the block.\n\nRequest: {request.strip()}\n"
            f"\nCurrent `{first.path.name}`:\n{fence}{lang}\n{body}{fence}\n"
        )
    which = f"`{labels[0]}`" if len(targets) == 1 else "the files below"
    parts = [
        f"Edit {which} as requested. Answer with SEARCH/REPLACE blocks, one per change, each like this:\n\n"
        f"{labels[0]}\n{SEARCH}\n(lines copied exactly from the current file)\n{DIVIDER}\n"
        f"(the new lines that replace them)\n{REPLACE}\n\n"
        "Copy the SEARCH lines character for character, with their indentation, and include enough of them to "
        "match one place only. Change nothing the request does not ask for. Explain after the blocks.\n\n"
        f"Request: {request.strip()}\n"
    ]
    for target, label in zip(targets, labels):
        fence, lang = _fence_for(target.text), target.language
        body = target.text if target.text.endswith("\n") or not target.text else target.text + "\n"
        parts.append(f"\nCurrent `{label}`:\n{fence}{lang}\n{body}{fence}\n")
    return "".join(parts)


def edit_labels(targets: list[EditTarget]) -> list[str]:
    """The name each file goes by in the prompt (and so in the reply): its file name, or as many of its last
    folders as tell it from the other attached files (two ``util.py``: ``a/util.py`` and ``b/util.py``)."""
    labels = []
    for target in targets:
        parts = target.path.parts
        for k in range(1, len(parts) + 1):
            label = "/".join(parts[-k:])
            if sum(o.path.as_posix().endswith("/" + label) for o in targets) <= 1:
                break
        labels.append(label)
    return labels


def build_file_context(path: str | os.PathLike[str]) -> str:
    """The text ``/file PATH`` adds to the conversation: the file in a fenced block, marked read-only."""
    target = load_edit_target(path, command="/file")
    fence = _fence_for(target.text)
    body = target.text if target.text.endswith("\n") or not target.text else target.text + "\n"
    head = f"Here is the file `{target.path.name}` for reference (read-only):"
    return f"{head}\n{fence}{target.language}\n{body}{fence}\n"


@dataclass(frozen=True, slots=True)
class CodeBlock:
    language: str  # the first word of the info string ("" when none)
    text: str  # the content, every line ending in "\n"
    closed: bool  # False: the reply ended inside the block (partial reply)
    line: int = -1  # the opening fence's line in the reply (0-based)


def code_blocks(reply: str) -> list[CodeBlock]:
    """Every fenced code block in a Markdown reply, in order (CommonMark fence rules, simplified)."""
    blocks: list[CodeBlock] = []
    lines = reply.replace("\r\n", "\n").split("\n")
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match or (match.group(2)[0] == "`" and "`" in match.group(3)):
            i += 1
            continue
        start, indent, fence, info = i, len(match.group(1)), match.group(2), match.group(3).strip()
        closing = re.compile(r"^ {0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        body: list[str] = []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            line = lines[i]
            strip = len(line) - len(line.lstrip(" "))
            body.append(line[min(indent, strip) :])
            i += 1
        closed = i < len(lines)
        if not closed and body and body[-1] == "":
            body.pop()  # the reply's trailing newline is not a line of the block
        blocks.append(CodeBlock(info.split()[0] if info else "", "".join(f"{b}\n" for b in body), closed, start))
        i += 1
    return blocks


def extract_code_block(reply: str, language: str | None = None) -> str | None:
    """The reply's largest fenced code block (the last of equal ones), preferring blocks tagged ``language``."""
    blocks = code_blocks(reply)
    if language:
        tagged = [b for b in blocks if b.language.lower() == language.lower()]
        blocks = tagged or blocks
    if not blocks:
        return None
    return max(reversed(blocks), key=lambda b: len(b.text)).text
