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
- A model block is read by ``model_spec.parse_spec``: ``source:`` alone is enough (``packaged:NAME``,
  ``hf:ORG/NAME/FILE.gguf``, a ``.gguf`` path, a local directory or a hub id; relative paths are relative to the
  folder of the YAML file that names them); the sizes come from the model's files, numbers written beside it are
  overrides checked against them. A pair needs only ``name`` and ``target``: ``drafter`` defaults to
  ``draft-model`` when a ``draft`` is given, else ``prompt-lookup``; ``context_length`` to the smaller of
  ``api.DEFAULT_CONTEXT`` and the context the target states (more than it states is refused). The schema itself
  is documented at the top of ``models.yaml``.
"""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specchat.backend.errors import ConfigError
from specchat.backend.limits import (
    DEFAULT_CONTEXT,
    DEFAULT_PAIR,
    MAX_CONTEXT,
    MAX_GAMMA,
    MAX_REMOTE_TIMEOUT_S,
    MIN_CONTEXT,
    MIN_REMOTE_TIMEOUT_S,
    PAIR_DRAFTERS,
    REMOTE_DEADLINE_S,
    REMOTE_NO_PROGRESS_S,
    SAMPLING_LIMITS,
    is_gamma,
)
from specchat.backend.models.catalog.config_fields import MISSING as _MISSING
from specchat.backend.models.catalog.config_fields import Where as _Where
from specchat.backend.models.catalog.config_fields import bounded_int as _bounded_int
from specchat.backend.models.catalog.config_fields import choice as _choice
from specchat.backend.models.catalog.config_fields import reject_unknown as _reject_unknown
from specchat.backend.models.catalog.config_fields import take as _take
from specchat.backend.models.catalog.config_head import HEAD_DRAFTERS, HeadSpec, parse_head
from specchat.backend.models.catalog.config_yaml import read_yaml, shown
from specchat.backend.models.catalog.model_spec import (  # noqa: F401 - re-exported: the names importers use
    DTYPES,
    PACKAGED_MODELS,
    QUANTIZATIONS,
    REVISION,
    TORCH_QUANTIZATIONS,
    ModelSpec,
    parse_spec,
    resolve_source,
)
from specchat.backend.paths import config_dir, expand
from specchat.backend.redact import mask_url

REMOTE_DRAFTER = "server"  # a remote pair's drafter: whatever speculation its server was started with
# What a remote pair's server is: decides only which optional request fields are sent (the answers are read by
# what they contain). openai: the plain OpenAI API; specchat: `specchat serve`.
REMOTE_KINDS = ("openai", "vllm", "sglang", "llama-server", "specchat")
# The kinds whose servers take a request's prediction (OpenAI's Predicted Outputs; `specchat serve`): vLLM,
# SGLang and llama-server have none.
PREDICTION_KINDS = ("openai", "specchat")
_PAIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Optional user:password@ (sent as HTTP basic auth; masked in every message: backend/redact.py).
_SERVER_URL = re.compile(r"^https?://([!-~]+@)?[A-Za-z0-9.\-_\[\]:%]+(:\d{1,5})?(/[!-~]*)?\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    """A remote pair's target: an OpenAI-compatible server and the model name it serves."""

    server: str  # base URL as written, without a trailing "/", e.g. http://127.0.0.1:8000/v1
    model: str  # the server's model id (`GET {server}/models`)
    server_kind: str = "openai"  # one of REMOTE_KINDS
    api_key_env: str | None = None  # environment variable holding the API key (sent as a Bearer token)
    no_progress_s: float = REMOTE_NO_PROGRESS_S  # no new token for this long ends the request (limits.py)
    deadline_s: float = REMOTE_DEADLINE_S  # a request not finished by then ends

    @property
    def kind(self) -> str:
        return "remote"

    @property
    def source(self) -> str:
        return f"{self.model} @ {mask_url(self.server)}"


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

    @property
    def local_target(self) -> ModelSpec:
        """The target of a pair run in this process. Raises ConfigError for a remote pair (its server runs it)."""
        if isinstance(self.target, RemoteSpec):
            raise ConfigError(
                f"pair '{self.name}': its model runs on the server {self.target.server}, not in this process; "
                "use it through the remote engine"
            )
        return self.target


_SAMPLING = {  # key -> (types, check, message): the engine's own limits (backend/limits.py)
    key: ((int,) if key in ("top_k", "max_new_tokens") else (int, float), *SAMPLING_LIMITS[key])
    for key in ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens")
}
_PAIR_FIELDS = {"name", "description", "target", "drafter", "draft", "gamma", "context_length", "sampling", "head"}
_REMOTE_PAIR_FIELDS = {"name", "description", "target", "sampling"}
_REMOTE_FIELDS = {"server", "model", "kind", "api_key_env", "no_progress_s", "deadline_s"}


def _parse_remote(file: Path, pair: str, node: Any) -> RemoteSpec:
    where = _Where(file, pair, node, prefix="target.")
    _reject_unknown(where, _REMOTE_FIELDS)
    server = _take(where, "server", (str,), "the server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    server = server.strip().rstrip("/")
    if not _SERVER_URL.match(server):
        raise where.error(
            "server",
            mask_url(server),
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
    no_progress_s, deadline_s = (
        _seconds(where, key, default)
        for key, default in (("no_progress_s", REMOTE_NO_PROGRESS_S), ("deadline_s", REMOTE_DEADLINE_S))
    )
    return RemoteSpec(
        server=server,
        model=model,
        server_kind=kind,
        api_key_env=key_env,
        no_progress_s=no_progress_s,
        deadline_s=deadline_s,
    )


def _seconds(where: _Where, key: str, default: float) -> float:
    """A remote pair's timeout field: seconds in [MIN_REMOTE_TIMEOUT_S, MAX_REMOTE_TIMEOUT_S]."""
    fix = f"seconds from {MIN_REMOTE_TIMEOUT_S:g} to {MAX_REMOTE_TIMEOUT_S:g}, e.g. {default:g}"
    value = _take(where, key, (int, float), fix, default)
    if not MIN_REMOTE_TIMEOUT_S <= value <= MAX_REMOTE_TIMEOUT_S:  # NaN fails too
        raise where.error(key, value, "out of range", f"use {fix}")
    return float(value)


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
    target = parse_spec(file, name, "target", _take(where, "target", (dict,), "a model block"), node)
    draft_node = _take(where, "draft", (dict,), "a model block", None)
    drafter = _choice(where, "drafter", PAIR_DRAFTERS, "draft-model" if draft_node is not None else "prompt-lookup")
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
    draft = parse_spec(file, name, "draft", draft_node, node) if draft_node is not None else None
    head = _parse_pair_head(file, where, node, drafter)
    gamma = _take(where, "gamma", (int, str), f"an integer 1..{MAX_GAMMA} or auto", "auto")
    if not is_gamma(gamma):
        raise where.error(
            "gamma", gamma, "not a valid number of drafted tokens", f"use an integer from 1 to {MAX_GAMMA}, or auto"
        )
    stated = target.context_max or DEFAULT_CONTEXT
    context_length = _bounded_int(
        where,
        "context_length",
        MIN_CONTEXT,
        MAX_CONTEXT,
        "tokens of context the KV cache holds, e.g. 8192",
        max(MIN_CONTEXT, min(DEFAULT_CONTEXT, stated)),
    )
    if target.context_max and context_length > target.context_max:
        raise where.error(
            "context_length",
            context_length,
            f"the model states a longest context of {target.context_max} tokens ({target.facts_file})",
            f"use at most {target.context_max}",
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
    return parse_head(node["head"], file.parent, where.error, resolve_source, REVISION.fullmatch)


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
    return Path(__file__).resolve().parent.parent / "models.yaml"


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
