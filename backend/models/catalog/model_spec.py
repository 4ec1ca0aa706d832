"""One model of a pair (a models.yaml model block): where it comes from, and its sizes, read from its own files.

Contract:

- :func:`resolve_source(source, base_dir=None)` classifies a source: ``packaged:NAME``; ``hf:ORG/NAME/FILE.gguf`` (a
  GGUF file of a hub repository, kind ``hub-gguf``); a path ending ``.gguf`` (an existing file, kind ``gguf``); an
  existing local directory (``local``); else a hub id ``org/name`` (``hub``). Relative paths are relative to
  ``base_dir`` (the YAML file's folder). ValueError says why a source is none of these.
- :func:`parse_spec(...)` reads a model block. ``params``, ``num_layers``, ``num_kv_heads``, ``head_dim``,
  ``hidden_size`` and ``vocab_size`` are optional: the model's files state them (``spec_facts.facts_for``: the
  GGUF's metadata, or config.json and the safetensors headers; a hub source only once it is in the local cache,
  nothing is fetched here). A number written in the block is an override, and where the file states it too the
  two must agree: a mismatch is a ConfigError naming the field, both values and the file. ``ModelSpec.origins``
  says where each number came from (``file``, ``override``, or ``unknown`` until a hub download).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specchat.backend.limits import MODEL_SIZE_LIMITS
from specchat.backend.models.catalog.config_fields import Where, bounded_int, choice, reject_unknown, take
from specchat.backend.models.catalog.config_yaml import shown
from specchat.backend.models.facts.spec_facts import PACKAGED_MODELS, facts_for  # noqa: F401 - PACKAGED_MODELS re-exported
from specchat.backend.paths import expand

DTYPES = ("auto", "float32", "bfloat16", "float16")
TORCH_QUANTIZATIONS = (
    "int4-torch",
    "int8-torch",
)  # PyTorch's own int4/int8 kernels (backend/models/loading/quantized.py)
QUANTIZATIONS = ("none", "nf4", "int8", *TORCH_QUANTIZATIONS)
GGUF_KINDS = ("packaged", "gguf", "hub-gguf")  # sources that are one GGUF file
# huggingface_hub's own rule for each half of org/name (validate_repo_id): 1-96 of letters, digits, '_', '.', '-',
# starting with a letter or digit and ending with one or '_'; no '--' or '..'; not ending in '.git'. Matched whole
# (fullmatch): a '$' would let a trailing newline through.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_ID = re.compile(f"{_HUB_PART}/{_HUB_PART}")
# hf:ORG/NAME/FILE.gguf: a file (possibly in a folder) of a hub repository, ending .gguf
_HUB_FILE = re.compile(rf"hf:({_HUB_PART}/{_HUB_PART})/((?:[A-Za-z0-9_.+-]+/)*[A-Za-z0-9_.+-]+\.gguf)", re.IGNORECASE)
# A branch, tag or commit (git's ref-name rules): printable ASCII without spaces or ~ ^ : ? * [ \
REVISION = re.compile(r"[^\x00-\x20\x7f-\U0010ffff~^:?*\[\\]{1,255}")
SIZE_FIELDS = ("params", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    source: str  # as written: "packaged:NAME", "hf:ORG/NAME/FILE.gguf", a hub id "org/name", a directory, a .gguf
    kind: str  # resolved: "packaged" | "hub" | "hub-gguf" | "local" | "gguf"
    revision: str | None
    dtype: str  # "auto" | "float32" | "bfloat16" | "float16"
    quantization: str  # "none" | "nf4" | "int8" (bitsandbytes) | "int4-torch" | "int8-torch" (PyTorch kernels)
    params: int  # parameter count (0: unknown until the hub files are here)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int  # output rows (may exceed the tokenizer's ids: padding)
    download_bytes: int  # 0 for packaged/local
    gated: bool
    allow_pickle: bool = False
    trust_remote_code: bool = False
    tie_word_embeddings: bool = False  # input and output embedding share weights (counted once in params)
    path: str | None = None  # absolute path for kind "local"/"gguf" (and a cached "hub-gguf"); else None
    # Where each size came from: ((field, "file" | "override" | "unknown"), ...), in SIZE_FIELDS order.
    origins: tuple[tuple[str, str], ...] = ()
    weight_bytes: int = 0  # the weights as the files store them (0: unknown)
    weight_types: tuple[tuple[str, int], ...] = ()  # stored type -> bytes (GGUF types, safetensors dtypes)
    context_max: int = 0  # the longest context the model states (max_position_embeddings; 0: unknown)
    architecture: str = ""  # transformers model_type, or the GGUF's architecture ("" unknown)
    chat_template: bool | None = None  # the files carry a chat template (None: not known yet)
    facts_file: str = ""  # the file the sizes were read from

    @property
    def hub_repo(self) -> str | None:
        """The hub repository of a ``hub`` or ``hub-gguf`` source."""
        if self.kind == "hub":
            return self.source
        match = _HUB_FILE.fullmatch(self.source) if self.kind == "hub-gguf" else None
        return match.group(1) if match else None

    @property
    def hub_filename(self) -> str | None:
        """The file inside the repository of a ``hub-gguf`` source."""
        match = _HUB_FILE.fullmatch(self.source) if self.kind == "hub-gguf" else None
        return match.group(2) if match else None

    @property
    def sizes_known(self) -> bool:
        return all(getattr(self, name) > 0 for name in SIZE_FIELDS)

    def origin(self, name: str) -> str:
        return dict(self.origins).get(name, "override")


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISREG, "a file"),
)


def what_is(path: Path) -> str:
    """What is at ``path``, for an error: "does not exist", "is a named pipe (FIFO), not ...", "is a symlink to a
    character device (/dev/null)", "is a broken symlink (to x)". Reads nothing (a FIFO would block a read)."""
    try:
        link = path.is_symlink()
        mode = path.stat().st_mode
    except OSError:
        if link:
            try:
                return f"is a broken symlink (to {shown(os.readlink(path))})"
            except OSError:
                return "is a broken symlink"
        return "does not exist"
    kind = next((name for test, name in _KINDS if test(mode)), "not a file or folder")
    if link:
        return f"is a symlink to {kind} ({shown(str(path.resolve()))})"
    return f"is {kind}"


def resolve_source(source: str, *, base_dir: Path | None = None) -> tuple[str, str | None]:
    """Classify a source string: returns (kind, absolute path or None). Raises ValueError with the reason."""
    if source.startswith("packaged:"):
        name = source.removeprefix("packaged:")
        if name not in PACKAGED_MODELS:
            raise ValueError(f"no packaged model named {shown(name)} (known: {', '.join(PACKAGED_MODELS)})")
        return "packaged", None
    if source.startswith("hf:"):
        match = _HUB_FILE.fullmatch(source)
        if match is None or "--" in match.group(1) or ".." in source:
            raise ValueError(
                "not a hub GGUF file: write hf:ORG/NAME/FILE.gguf, e.g. "
                "hf:Qwen/Qwen2.5-Coder-7B-Instruct-GGUF/qwen2.5-coder-7b-instruct-q4_k_m.gguf"
            )
        return "hub-gguf", None
    base = base_dir or Path.cwd()
    path = expand(source)
    path = path if path.is_absolute() else base / path
    where = str(path) if str(path).isprintable() else shown(str(path))  # a newline in a path stays on one line
    if source.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file {where} {what_is(path)}; name a GGUF model file")
        return "gguf", str(path.resolve())
    if path.is_dir():
        return "local", str(path.resolve())
    if source.startswith(("/", "~", ".", "\\")) or re.match(r"^[A-Za-z]:[\\/]", source):
        raise ValueError(f"local directory {where} {what_is(path)}; name a model's folder")
    if HUB_ID.fullmatch(source) and "--" not in source and ".." not in source and not source.endswith(".git"):
        return "hub", None
    raise ValueError(
        "not packaged:NAME, hf:ORG/NAME/FILE.gguf, an existing directory, a .gguf file, or a hub id of the form "
        "org/name (letters, digits, '_', '.' and '-', each half starting and ending with a letter or digit)"
    )


_SPEC_INT_FIELDS = {  # field -> (minimum, where a user finds the number)
    "params": (1, "the parameter count, e.g. from the model card"),
    "num_layers": (1, "config.json: num_hidden_layers"),
    "num_kv_heads": (1, "config.json: num_key_value_heads"),
    "head_dim": (1, "config.json: head_dim, else hidden_size / num_attention_heads"),
    "hidden_size": (1, "config.json: hidden_size"),
    "vocab_size": (1, "config.json: vocab_size (output rows)"),
}
SPEC_FIELDS = {
    "source",
    "revision",
    "dtype",
    "quantization",
    "download_bytes",
    "gated",
    "allow_pickle",
    "trust_remote_code",
    "tie_word_embeddings",
    *_SPEC_INT_FIELDS,
}


def parse_spec(file: Path, pair: str, role: str, node: Any, parent: dict[str, Any]) -> ModelSpec:
    """The model block ``node`` (the pair's ``role``: target or draft) of ``file`` (see the module docstring)."""
    if not isinstance(node, dict):
        raise Where(file, pair, parent).error(
            role, node, "expected a mapping of model fields", "write it as an indented block with at least source:"
        )
    where = Where(file, pair, node, prefix=f"{role}.")
    reject_unknown(where, SPEC_FIELDS)
    source = take(
        where, "source", (str,), "packaged:NAME, hf:ORG/NAME/FILE.gguf, a hub id org/name, a directory or a .gguf file"
    )
    try:
        kind, path = resolve_source(source, base_dir=file.parent)
    except ValueError as exc:
        raise where.error("source", source, str(exc), "fix the path or hub id") from None
    revision = take(where, "revision", (str,), "a branch, tag or commit of the hub repository", None)
    if revision is not None and not REVISION.fullmatch(revision):
        raise where.error(
            "revision",
            revision,
            "not a branch, tag or commit name",
            "use printable ASCII without spaces or ~ ^ : ? * [ \\ (e.g. main, v1.0 or a commit hash)",
        )
    if revision is not None and kind not in ("hub", "hub-gguf"):
        raise where.error(
            "revision", revision, f"only hub sources have revisions (this one is {kind})", "remove revision"
        )
    given: dict[str, Any] = {
        k: bounded_int(where, k, low, MODEL_SIZE_LIMITS.get(k, (0, None))[1], fix, None)
        for k, (low, fix) in _SPEC_INT_FIELDS.items()
    }
    flags: dict[str, Any] = {
        k: take(where, k, (bool,), "true or false", False) for k in ("gated", "allow_pickle", "trust_remote_code")
    }
    sizes: dict[str, Any] = {k: v or 0 for k, v in given.items()}
    spec = ModelSpec(
        source=source,
        kind=kind,
        revision=revision,
        dtype=choice(where, "dtype", DTYPES, "auto"),
        quantization=choice(where, "quantization", QUANTIZATIONS, "none"),
        download_bytes=bounded_int(where, "download_bytes", 0, None, "size of the weights in bytes", 0),
        path=path,
        tie_word_embeddings=take(where, "tie_word_embeddings", (bool,), "true or false", False),
        **sizes,
        **flags,
    )
    try:
        facts = facts_for(spec)
    except ValueError as exc:  # FactsError: the file itself cannot be read
        raise where.error("source", source, str(exc), "check the file, or download it again") from None
    if facts is None:
        origins = tuple((k, "override" if given[k] is not None else "unknown") for k in SIZE_FIELDS)
        return _replace(spec, origins=origins)
    for name, stated in facts.sizes().items():
        if name == "params" and not facts.params_exact:
            continue  # computed from config.json, not counted: an override is better, not wrong
        if given[name] is not None and given[name] != stated:
            raise where.error(
                name,
                given[name],
                f"the model's file {facts.where} says {stated}",
                "remove the field to use the file's number, or correct it",
            )
    return with_facts(spec, facts, overrides={k for k, v in given.items() if v is not None})


def with_facts(spec: ModelSpec, facts: Any, overrides: set[str] | None = None) -> ModelSpec:
    """``spec`` with the sizes and details ``facts`` (a ``model_facts.ModelFacts``) states filled in."""
    overrides = overrides if overrides is not None else {k for k, origin in spec.origins if origin == "override"}
    sizes = {k: getattr(spec, k) if k in overrides else v for k, v in facts.sizes().items()}
    return _replace(
        spec,
        **sizes,
        tie_word_embeddings=facts.tie_word_embeddings,
        origins=tuple((k, "override" if k in overrides else "file") for k in SIZE_FIELDS),
        weight_bytes=facts.weight_bytes,
        weight_types=tuple(sorted(facts.weight_types.items())),
        context_max=facts.context_length,
        architecture=facts.architecture,
        chat_template=facts.chat_template,
        facts_file=facts.where,
    )


def _replace(spec: ModelSpec, **changes: Any) -> ModelSpec:
    from dataclasses import replace

    return replace(spec, **changes)
