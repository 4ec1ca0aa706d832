"""A forward over the paged cache for a model switched to paged attention by hand (tests of one path): the path
named by the keyword (``graphs``: CUDA graphs, ``fast``: the compact loop, else transformers' forward), its logits
(with ``taps``: the logits and the hidden states)."""

from __future__ import annotations

from typing import Any

from specchat.backend.engine.forward_paths import CompactPath, EagerPath, ForwardPath, GraphPath, forward_paged


def paged_forward(model, seq, input_ids, *, graphs=None, fast=None, taps=None, **kwargs) -> Any:
    path: ForwardPath
    if graphs is not None:
        path = GraphPath(model, graphs)
    elif fast is not None:
        path = CompactPath(model, fast)
    else:
        path = EagerPath(model)
    out = forward_paged(path, seq, input_ids, taps=taps, config=model.config, **kwargs)
    return out.logits if taps is None else (out.logits, out.hidden)
