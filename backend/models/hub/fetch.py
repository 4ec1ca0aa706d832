"""Bringing a pair's hub files here before it loads, so that sizes unknown at parse time are read from them.

Contract: :func:`fetch_sources(pair, progress=None, confirm_download=None)` asks ``confirm_download(bytes)`` once for
everything the pair's hub sources still need (as ``loading.load_pair`` would: refused, or no one to ask, raises
``ModelLoadError``), downloads it (``hub.snapshot`` for hub ids, ``hub_gguf.fetch`` for ``hf:`` GGUF files, with
progress), then returns the pair with each model's sizes read from its files (``spec_facts.facts_for``); a number
models.yaml gives that the files contradict raises ``ConfigError`` naming the field, both values and the file, as
parsing does. The later ``load_pair`` then finds nothing left to download and does not ask again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specchat.backend.errors import ConfigError
from specchat.backend.models.catalog.config import PairConfig
from specchat.backend.models.catalog.model_spec import SIZE_FIELDS, ModelSpec, with_facts
from specchat.backend.models.facts.spec_facts import facts_for
from specchat.backend.models.hub import hub_gguf
from specchat.backend.models.hub import repos as hub
from specchat.backend.models.loading.capture import Progress, capture_library_output, user_callback


def _refreshed(pair: PairConfig, role: str, spec: ModelSpec) -> ModelSpec:
    facts = facts_for(spec)
    if facts is None:
        return spec
    overrides = {name for name, origin in spec.origins if origin == "override"}
    for name in overrides & set(SIZE_FIELDS):
        stated = getattr(facts, name)
        if getattr(spec, name) != stated and (name != "params" or facts.params_exact):
            raise ConfigError(
                f"{pair.source_file}: pair '{pair.name}': field '{role}.{name}' = {getattr(spec, name)}: the model's "
                f"file {facts.where} says {stated}; remove the field to use the file's number, or correct it"
            )
    return with_facts(spec, facts, overrides)


def fetch_sources(
    pair: PairConfig, *, progress: Progress | None = None, confirm_download: Callable[[int], bool] | None = None
) -> PairConfig:
    """See the module docstring."""
    target = pair.local_target
    draft = pair.draft if pair.drafter == "draft-model" else None
    specs = [s for s in (target, draft) if s is not None]
    progress, confirm_download = user_callback(progress), user_callback(confirm_download)
    with capture_library_output(progress):
        hub.confirm_download(specs, confirm_download, f"pair '{pair.name}'")
        for spec in specs:
            if spec.kind == "hub-gguf":
                hub_gguf.fetch(spec, progress)
            elif spec.kind == "hub":
                hub.snapshot(spec, progress=progress)
    new_target = _refreshed(pair, "target", target)
    new_draft = _refreshed(pair, "draft", pair.draft) if pair.draft is not None else None
    return replace(pair, target=new_target, draft=new_draft)
