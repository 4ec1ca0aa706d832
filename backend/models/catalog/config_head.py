"""A pair's draft head in models.yaml (``head:``): where its weights come from.

``head: SOURCE`` or ``head: {source: SOURCE, revision: REV, allow_pickle: BOOL}``, for ``drafter: eagle3 | medusa``
(and ``auto``, which then may pick the head). SOURCE is ``packaged:NAME`` (a head shipped inside specchat:
:data:`PACKAGED_HEADS`), an existing local directory (relative to the YAML file's folder) or a hub id
``org/name`` (downloaded into the HF cache after asking, like a model). A head folder holds ``config.json`` and
``model.safetensors`` (or ``pytorch_model.bin`` / ``medusa_lm_head.pt`` when ``allow_pickle`` is set: they are
read with ``torch.load(weights_only=True)``, which refuses code, but stay opt-in as for models).
``backend/models/loading/head_loading.py`` checks a head against its target and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specchat.backend.limits import HEAD_DRAFTERS  # noqa: F401 - re-exported: the name importers use

# Heads shipped as package data: name after "packaged:" -> folder inside backend/speculative/heads/data.
PACKAGED_HEADS = {"smollm2-135m-eagle3": "smollm2-135m-eagle3"}
_HEAD_FIELDS = {"source", "revision", "allow_pickle"}


@dataclass(frozen=True, slots=True)
class HeadSpec:
    source: str  # as written
    kind: str  # "packaged" | "local" | "hub"
    revision: str | None = None
    allow_pickle: bool = False
    path: str | None = None  # absolute folder for "local"; None otherwise

    def packaged_folder(self) -> Path:
        """The folder of a packaged head (it may be missing from a build that left the weights out)."""
        name = PACKAGED_HEADS[self.source.removeprefix("packaged:")]
        return Path(__file__).resolve().parents[2] / "speculative" / "heads" / "data" / name


def parse_head(node: Any, base_dir: Path, error, resolve, revision_ok) -> HeadSpec:
    """The ``head:`` value (a source string or a mapping); ``error(key, value, problem, fix)`` builds the
    ConfigError naming the field, ``resolve(source)`` classifies a source as models are, ``revision_ok(text)``
    checks a revision name."""
    if isinstance(node, str):
        node = {"source": node}
    if not isinstance(node, dict):
        raise error("head", node, "expected a source or a mapping", "write head: org/name or head: {source: ...}")
    unknown = sorted(str(k) for k in node if k not in _HEAD_FIELDS)
    if unknown:
        raise error(
            f"head.{unknown[0]}", node[unknown[0]], "unknown field", "allowed: " + ", ".join(sorted(_HEAD_FIELDS))
        )
    source = node.get("source")
    if not isinstance(source, str) or not source.strip():
        raise error(
            "head.source", source, "a head needs a source", "packaged:NAME, a local folder or a hub id org/name"
        )
    if source.startswith("packaged:"):
        if source.removeprefix("packaged:") not in PACKAGED_HEADS:
            raise error(
                "head.source", source, "no packaged head of that name", "use one of: " + ", ".join(PACKAGED_HEADS)
            )
        kind, path = "packaged", None
    else:
        try:
            kind, path = resolve(source, base_dir=base_dir)
        except ValueError as exc:
            raise error("head.source", source, str(exc), "fix the path or hub id") from None
        if kind not in ("local", "hub"):
            raise error("head.source", source, f"a head is a folder or a hub id, not a {kind} source", "fix the source")
    revision = node.get("revision")
    if revision is not None and (not isinstance(revision, str) or not revision_ok(revision) or kind != "hub"):
        raise error("head.revision", revision, "a branch, tag or commit, for hub heads only", "fix or remove it")
    allow_pickle = node.get("allow_pickle", False)
    if not isinstance(allow_pickle, bool):
        raise error("head.allow_pickle", allow_pickle, "expected true or false", "fix the value")
    return HeadSpec(source=source, kind=kind, revision=revision, allow_pickle=allow_pickle, path=path)
