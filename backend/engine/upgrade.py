"""The CPU native model swapped in between replies, once the kernels a first start builds in the background are
loaded (``backend/kernels/native.py``).

Why: building the kernels takes minutes on a small machine; a first start replies at once on the path that needs
no compiler (the int4 compact forward for llama-family Q4_0 / Q4_1 files with ``quantization: int4-torch``,
transformers' forward otherwise) and moves to the native model when it can.

Contract: :func:`between_replies(engine)` is called with the engine's lock held before a reply starts: by
``Engine.generate``, and by the batch scheduler (``batch.py``) while no stream is active. While a model of the
engine waits for the kernels (its ``native_reason`` starts with ``native_library.BUILDING``) it asks
``native.poll()``; once the library is loaded it loads the native model of each such spec (the tokenizer kept), and
if it fits in the memory free now, replaces the engine's runners, caches and drafters with ones over it: cached
conversations and prefix-cache entries are dropped (their K/V came from the other path), a draft head is attached
again over the new embedding, the γ policies start afresh (their pass costs were the other path's). Returns the new
start line when it swapped. A build that failed meanwhile leaves the models as they are with the failure as their
reason; a native load that fails is logged and keeps them. Replies on the two paths may differ (another summation
order): seeded replay is exact within one path (``docs/determinism.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from specchat.backend.engine.heap import release_code_pages
from specchat.backend.errors import SpecchatError
from specchat.backend.kernels import native
from specchat.backend.kernels.native_library import BUILDING
from specchat.backend.kv import attention
from specchat.backend.models.facts.memory import free_memory, native_scratch_bytes, native_weight_bytes
from specchat.backend.models.loading.native_loading import native_reason
from specchat.backend.models.loading.pair import LoadedModel, _load_weights, gguf_path


class Swappable(Protocol):
    """What :func:`between_replies` uses of the engine (typed here, not imported: engine.py imports this module)."""

    target: LoadedModel
    draft: LoadedModel | None
    context_length: int
    pair: Any

    @property
    def start_line(self) -> str: ...

    def use_models(self, target: LoadedModel, draft: LoadedModel | None) -> None: ...


log = logging.getLogger(__name__)


def waiting(loaded: LoadedModel | None) -> bool:
    """Whether ``loaded`` runs a slower path only until the kernels being built in the background are ready."""
    return loaded is not None and (loaded.native_reason or "").startswith(BUILDING)


def between_replies(engine: Swappable) -> str | None:
    """See the module docstring."""
    models = [m for m in (engine.target, engine.draft) if m is not None and waiting(m)]
    if not models:
        return None
    if not native.poll():
        if not native.building():  # the build failed: say so from now on
            for loaded in models:
                loaded.native_reason = f"the CPU kernels are unavailable: {native.reason()}"
        return None
    needed = sum(native_weight_bytes(m.spec) + native_scratch_bytes(m.spec, engine.context_length) for m in models)
    if needed > free_memory(torch.device("cpu")):
        for loaded in models:
            loaded.native_reason = (
                "the CPU kernels are ready; restart specchat to use them (too little memory free now)"
            )
        return None
    try:
        fresh = {id(m): _native(m) for m in models}
    except (SpecchatError, OSError, RuntimeError) as error:
        log.warning("the CPU native model could not be swapped in: %s", error)
        for loaded in models:
            loaded.native_reason = f"the CPU native model did not load: {error}"
        return None
    target = fresh.get(id(engine.target), engine.target)
    draft = fresh.get(id(engine.draft), engine.draft) if engine.draft is not None else None
    engine.use_models(target, draft)
    release_code_pages()  # the library's load ran torch's registration code once more
    log.info("%s now runs on %s", engine.pair.name, engine.start_line)
    return engine.start_line


def _native(loaded: LoadedModel) -> LoadedModel:
    """The native model of ``loaded``'s spec (its tokenizer kept), or the error that stopped it."""
    spec = loaded.spec
    why = native_reason(spec, loaded.device, attention.ATTN_IMPLEMENTATION, None, gguf_path(spec))
    if why is not None:
        raise RuntimeError(why or "the native model is not in question here")
    made = _load_weights(
        spec,
        loaded.device,
        attn_implementation=attention.ATTN_IMPLEMENTATION,
        progress=None,
        tokenizer=loaded.tokenizer,
        native=None,
    )
    if made.native_reason is not None:
        raise RuntimeError(made.native_reason)
    return made
