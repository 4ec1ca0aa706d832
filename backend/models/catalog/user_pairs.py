"""Adding a pair to the user's models.yaml without making the file worse (``specchat add``).

Contract:

- :func:`pair_entry(name, target, draft=None, base_dir=None)` is the YAML text of one pair (``- name: ...`` with
  ``target: {source: ...}`` and, given a draft, ``drafter: draft-model`` and ``draft: {source: ...}``); relative
  paths are made absolute (the user's file lives elsewhere), sources are quoted as YAML strings.
- :func:`default_name(source)` is a pair name made from a source (a GGUF file's stem, a hub id's name, a folder's
  name), lower case, within the names models.yaml accepts.
- :func:`append_pair(file, entry, name)` appends ``entry`` to ``file`` as text, so every comment, pair and blank
  line already there stays as it was (a missing file is created with a header comment). Before anything is
  written the result is parsed as a whole (``config.load_pairs_file``: sources, sizes and overrides checked) and
  must hold the file's earlier pairs unchanged, in order, plus the new one; otherwise (a flow-style ``pairs: [...]``
  the text cannot be appended to, a name already used, an invalid source, a folder that holds no checkpoint
  (:func:`check_folder`), absurd sizes in the model's files) :class:`ConfigError` says why, naming the user's file
  and the pair (never the trial copy it parsed), and the file is untouched. ``taken`` (name -> the file that
  defines it: the packaged pairs) refuses a name that would replace another file's pair unless
  ``replace_taken``. The write is atomic (``files.write_atomic``). Returns the new pair as parsed.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from specchat.backend.errors import ConfigError
from specchat.backend.files import write_atomic
from specchat.backend.models.catalog.config import PairConfig, load_pairs_file
from specchat.backend.models.catalog.config_yaml import shown
from specchat.backend.models.catalog.model_spec import resolve_source
from specchat.backend.paths import expand

HEADER = (
    "# Your own model pairs (specchat add writes here; edit freely). Same layout as the packaged models.yaml:\n"
    "# a pair needs a name and a target source; sizes are read from the model's files.\n"
    "pairs:\n"
)
_ITEM = re.compile(r"^([ \t]*)- ", re.MULTILINE)


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def _absolute(source: str, base_dir: Path | None) -> str:
    try:
        kind, path = resolve_source(source, base_dir=base_dir)
    except ValueError as exc:
        raise ConfigError(f"source {source!r}: {exc}") from None
    return path if kind in ("gguf", "local") and path else source


def default_name(source: str) -> str:
    """See the module docstring."""
    tail = source.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    if tail.lower().endswith(".gguf"):
        tail = tail[: -len(".gguf")]
    name = re.sub(r"[^a-z0-9_.-]+", "-", tail.lower()).strip("-._")[:64] or "my-model"
    return name if name[0].isalnum() else f"m{name}"[:64]


def pair_entry(name: str, target: str, draft: str | None = None, *, base_dir: Path | None = None, indent: str = "  "):
    """See the module docstring."""
    lines = [
        f"{indent}- name: {_quoted(name)}",
        f"{indent}  target:",
        f"{indent}    source: {_quoted(_absolute(target, base_dir))}",
    ]
    if draft is not None:
        lines += [
            f"{indent}  drafter: draft-model",
            f"{indent}  draft:",
            f"{indent}    source: {_quoted(_absolute(draft, base_dir))}",
        ]
    return "\n".join(lines) + "\n"


def _indent_of(text: str) -> str:
    after = text.split("pairs:", 1)[1] if "pairs:" in text else ""
    match = _ITEM.search(after)
    return match.group(1) if match else "  "


_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # what loading reads from a checkpoint folder


def check_folder(source: str, role: str) -> None:
    """A ``local`` source must hold a checkpoint (config.json and weights): say what the folder lacks now, not at
    the first load in transformers' words. A folder holding GGUF files names them instead."""
    try:
        kind, path = resolve_source(source, base_dir=Path.cwd())
    except ValueError as exc:
        raise ConfigError(f"{role} {source!r}: {exc}") from None
    if kind != "local" or path is None:
        return
    folder = Path(path)
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))[:3]
    missing = [what for what, found in (
        ("config.json", (folder / "config.json").is_file()),
        ("weights (*.safetensors)", any(any(folder.glob(pattern)) for pattern in _WEIGHTS)),
    ) if not found]  # fmt: skip
    if not missing:
        return
    empty = "is empty" if not any(folder.iterdir()) else "holds no model: it lacks " + " and ".join(missing)
    hint = (
        f"; add the .gguf file itself, e.g. specchat add {shell_quoted(str(folder / ggufs[0]))}"
        if ggufs
        else "; add a Hugging Face checkpoint folder, a .gguf file or a hub id"
    )
    raise ConfigError(f"{role} folder {shown(str(folder))} {empty}{hint}")


def shell_quoted(text: str) -> str:
    import shlex

    return shlex.quote(text)


def append_pair(
    file: str | Path,
    name: str,
    target: str,
    draft: str | None = None,
    *,
    taken: dict[str, str] | None = None,
    replace_taken: bool = False,
) -> PairConfig:
    """See the module docstring."""
    file = expand(file)
    before_text = file.read_text(encoding="utf-8") if file.is_file() else ""
    before = _parsed(file, lambda: load_pairs_file(file) if before_text.strip() else {})
    if name in before:
        raise ConfigError(f"{file}: a pair named {name!r} is already there; choose another --name, or edit the file")
    if name in (taken or {}) and not replace_taken:
        raise ConfigError(
            f"a pair named {name!r} already comes from {(taken or {})[name]}; a pair of that name in {file} would "
            f"replace it: choose another --name, or pass --replace to replace it"
        )
    for role, source in (("target", target), ("draft", draft)):
        if source is not None:
            check_folder(source, role)
    if before_text.strip() and not re.search(r"^pairs:\s*(#.*)?$", before_text, re.MULTILINE):
        raise ConfigError(
            f"{file}: its pairs are not a block list under 'pairs:' (e.g. written [...] on one line), so a pair "
            "cannot be added without rewriting it; add this pair by hand:\n"
            + pair_entry(name, target, draft, base_dir=Path.cwd())
        )
    text = before_text if before_text.strip() else HEADER
    if not text.endswith("\n"):
        text += "\n"
    text += pair_entry(name, target, draft, base_dir=Path.cwd(), indent=_indent_of(text))
    file.parent.mkdir(parents=True, exist_ok=True)
    # The trial sits beside the file: relative sources in it resolve as they will from the file itself.
    handle, name_of_trial = tempfile.mkstemp(dir=file.parent, prefix=".add-", suffix=".yaml")
    trial = Path(name_of_trial)
    try:
        with open(handle, "w", encoding="utf-8") as out:
            out.write(text)
        parsed = _parsed(file, lambda: load_pairs_file(trial), trial, name)
        after = {n: replace(p, source_file=str(file)) for n, p in parsed.items()}
    finally:
        trial.unlink(missing_ok=True)
    kept = [n for n in after if n in before]
    if kept != list(before) or list(after) != [*before, name]:
        raise ConfigError(f"{file}: adding the pair would change the pairs already there; add it by hand")
    write_atomic(file, text)
    return after[name]


def _parsed(file: Path, parse: Any, trial: Path | None = None, name: str | None = None) -> dict[str, PairConfig]:
    """``parse()``, its ConfigError naming the user's ``file`` (and the pair being added) instead of the trial copy
    it read (the same text, so its line numbers hold)."""
    try:
        result: dict[str, PairConfig] = parse()
        return result
    except ConfigError as error:
        message = str(error).replace(str(trial), str(file)) if trial is not None else str(error)
        prefix = f"adding pair '{name}': " if name is not None else f"{file} cannot be read, so nothing is added: "
        raise ConfigError(prefix + message) from None
