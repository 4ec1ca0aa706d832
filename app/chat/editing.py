"""`/edit PATH` and `/file PATH`: attach a local text file, ask for changes, show a diff, write it back safely.

Contract:
- :func:`load_edit_target` reads a UTF-8 text file of at most ``MAX_FILE_BYTES`` (256 KiB) and remembers its
  bytes' SHA-256 and mtime; every refusal (missing, a folder, not a regular file, too big, unreadable, binary,
  not UTF-8) raises :class:`EditError` naming the path and what to do. :func:`check_writable` says before the
  model runs whether the file could be saved. ``/file`` (:func:`build_file_context`) validates the same way.
- Text is handled with ``\\n`` line ends; a CRLF file and a UTF-8 BOM are restored when writing.
- :func:`extract_code_block` takes the reply's largest fenced block (``` or ~~~, any info string, an unclosed
  block at the end of a partial reply included); it never raises on any text.
- :func:`apply_edit` writes only ``target.path`` (symlinks resolved at load: the link stays a link), after the
  UI's confirmation: it refuses when the file's content changed since it was loaded, copies the original to
  ``<name>.specchat-bak-<timestamp>`` (never overwriting anything), then replaces the file atomically
  (``specchat.backend.files.write_atomic``: the old or the new content, never a part), keeping its permission
  bits and, where allowed, its owner. Model output is only ever written as file content, never executed or
  interpreted.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from specchat.backend.errors import SpecchatError
from specchat.backend.files import write_atomic

MAX_FILE_BYTES = 256 * 1024
BACKUP_MARK = ".specchat-bak"

_LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript",
    ".ts": "typescript", ".tsx": "tsx", ".jsx": "jsx", ".rs": "rust", ".go": "go", ".c": "c", ".h": "c",
    ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".hpp": "cpp", ".hh": "cpp", ".java": "java", ".kt": "kotlin",
    ".swift": "swift", ".cs": "csharp", ".rb": "ruby", ".php": "php", ".lua": "lua", ".pl": "perl", ".r": "r",
    ".jl": "julia", ".hs": "haskell", ".ml": "ocaml", ".ex": "elixir", ".exs": "elixir", ".erl": "erlang",
    ".scala": "scala", ".dart": "dart", ".zig": "zig", ".sh": "bash", ".bash": "bash", ".zsh": "zsh",
    ".fish": "fish", ".ps1": "powershell", ".sql": "sql", ".html": "html", ".htm": "html", ".css": "css",
    ".tcss": "css", ".scss": "scss", ".xml": "xml", ".json": "json", ".yaml": "yaml", ".yml": "yaml",
    ".toml": "toml", ".ini": "ini", ".cfg": "ini", ".md": "markdown", ".rst": "rst", ".tex": "latex",
    ".vue": "vue", ".svelte": "svelte", ".txt": "text",
}
_NAMED_LANGUAGES = {"makefile": "make", "dockerfile": "dockerfile", "cmakelists.txt": "cmake"}

# An opening fence: up to 3 spaces, 3+ backticks or tildes, then the info string (no backtick for ``` fences).
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


class EditError(SpecchatError):
    """A file cannot be attached, edited or saved; the message names the path and what to do."""


@dataclass(frozen=True, slots=True)
class EditTarget:
    path: Path  # absolute, symlinks resolved: the only file apply_edit writes
    text: str  # the content, "\n" line ends
    encoding: str  # "utf-8" or "utf-8-sig" (a BOM to restore)
    mtime: float  # st_mtime when loaded (shown to the user; changes are detected by sha256)
    sha256: str  # of the bytes on disk when loaded
    newline: str = "\n"  # "\r\n" for a CRLF file: restored on write
    display: str = ""  # the path as the user typed it, for messages

    @property
    def language(self) -> str:
        return language_for(self.path)


def language_for(path: Path) -> str:
    """The Markdown fence language tag for a file name ("text" when unknown)."""
    return _NAMED_LANGUAGES.get(path.name.lower()) or _LANGUAGES.get(path.suffix.lower(), "text")


def _size(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MiB" if n >= 1024 * 1024 else f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


def load_edit_target(path: str | os.PathLike[str], *, command: str = "/edit") -> EditTarget:
    """Read and validate a file for ``/edit`` (or ``/file``: pass ``command`` for the messages)."""
    shown = str(path)
    given = Path(path).expanduser()
    if not given.is_absolute():
        given = Path.cwd() / given
    where = f"{command} {shown}"
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
    newline = "\r\n" if "\r\n" in text else "\n"
    return EditTarget(
        path=real,
        text=text.replace("\r\n", "\n"),
        encoding=encoding,
        mtime=st.st_mtime,
        sha256=hashlib.sha256(data).hexdigest(),
        newline=newline,
        display=shown,
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


def build_edit_prompt(target: EditTarget, request: str) -> str:
    """The user message for ``/edit PATH request``: the request, then the whole file in a fenced block."""
    if not request.strip():
        raise EditError(
            f"/edit {target.display or target.path}: say what to change after the path, e.g. "
            f"/edit {target.display or target.path} add type hints"
        )
    fence, lang, name = _fence_for(target.text), target.language, target.path.name
    body = target.text if target.text.endswith("\n") or not target.text else target.text + "\n"
    return (
        f"Edit the file `{name}` as requested below. Reply with the complete updated file in one fenced code block "
        f"tagged `{lang}` (the whole file, not only the changed part), keep everything the request does not ask "
        "to change exactly as it is, and put any explanation after the block.\n\n"
        f"Request: {request.strip()}\n\n"
        f"Current `{name}`:\n{fence}{lang}\n{body}{fence}\n"
    )


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
        indent, fence, info = len(match.group(1)), match.group(2), match.group(3).strip()
        closing = re.compile(r"^ {0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        body: list[str] = []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            line = lines[i]
            strip = len(line) - len(line.lstrip(" "))
            body.append(line[min(indent, strip):])
            i += 1
        closed = i < len(lines)
        if not closed and body and body[-1] == "":
            body.pop()  # the reply's trailing newline is not a line of the block
        blocks.append(CodeBlock(info.split()[0] if info else "", "".join(f"{b}\n" for b in body), closed))
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


def _match_final_newline(target: EditTarget, new_text: str) -> str:
    # A fenced block always ends its last line; keep the file's own convention instead.
    if target.text and not target.text.endswith("\n") and new_text.endswith("\n"):
        return new_text[:-1]
    return new_text


def unified_diff(target: EditTarget, new_text: str) -> str:
    """A unified diff from the loaded file to ``new_text`` ("" when identical)."""
    new_text = _match_final_newline(target, new_text.replace("\r\n", "\n"))
    old_lines, new_lines = target.text.splitlines(keepends=True), new_text.splitlines(keepends=True)
    out = []
    name = target.display or target.path.name
    for line in difflib.unified_diff(old_lines, new_lines, f"a/{name}", f"b/{name}"):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def apply_edit(target: EditTarget, new_text: str) -> Path:
    """Write ``new_text`` to ``target.path`` (only there) after a backup; returns the backup's path."""
    shown = target.display or str(target.path)
    try:
        current = target.path.read_bytes()
        st = target.path.stat()
    except OSError as exc:
        raise EditError(
            f"/edit {shown}: cannot read {target.path} again before saving: {exc.strerror or exc}. Nothing was written."
        ) from None
    if hashlib.sha256(current).hexdigest() != target.sha256:
        raise EditError(
            f"/edit {shown}: {target.path} changed on disk since it was attached (modified "
            f"{time.strftime('%H:%M:%S', time.localtime(st.st_mtime))}); specchat will not overwrite those changes. "
            f"Nothing was written: run /edit {shown} again to edit the current version."
        )
    check_writable(target)
    text = _match_final_newline(target, new_text.replace("\r\n", "\n")).replace("\n", target.newline)
    try:
        payload = text.encode(target.encoding)
    except UnicodeEncodeError as exc:
        raise EditError(
            f"/edit {shown}: the new version cannot be saved as UTF-8 (character {exc.start}: {exc.reason}). "
            "Nothing was written; ask the model again."
        ) from None
    backup = _write_backup(target, current, st)
    try:
        write_atomic(target.path, payload, mode=stat.S_IMODE(st.st_mode))
    except OSError as exc:
        raise EditError(
            f"/edit {shown}: could not write {target.path}: {exc.strerror or exc}. The file is unchanged; "
            f"the backup is {backup}."
        ) from None
    if hasattr(os, "chown") and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(target.path, st.st_uid, st.st_gid)
        except OSError:
            pass  # not allowed (not root): the new file is ours, as any editor would leave it
    return backup


def _write_backup(target: EditTarget, data: bytes, st: os.stat_result) -> Path:
    """Copy the original bytes to a new ``<name>.specchat-bak-<timestamp>[-n]`` (O_EXCL: never overwrites)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    shown = target.display or target.path
    for n in range(1, 1000):
        backup = target.path.with_name(f"{target.path.name}{BACKUP_MARK}-{stamp}{'' if n == 1 else f'-{n}'}")
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IMODE(st.st_mode) | stat.S_IWUSR)
        except FileExistsError:
            continue
        except OSError as exc:
            raise EditError(
                f"/edit {shown}: could not create the backup {backup}: {exc.strerror or exc}. Nothing was written."
            ) from None
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            backup.unlink(missing_ok=True)
            raise EditError(
                f"/edit {shown}: could not write the backup {backup}: {exc.strerror or exc}. Nothing was written."
            ) from None
        return backup
    raise EditError(f"/edit {shown}: 999 backups from this second already exist next to it; remove some.")
