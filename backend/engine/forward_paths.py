"""The forward paths a model can run on: one per device and weight format, chosen once when the model loads
(:class:`~specchat.backend.engine.runner.ModelRunner`).

Contract: a :class:`ForwardPath` runs one forward over ``ids`` appended after ``seq``'s committed tokens and
returns a :class:`Pass`: the float logits of the last ``keep`` rows and, when ``taps`` are asked for, the residual
stream at those points for every row. It reserves the rows' cache slots but does NOT commit: the caller keeps what
it accepts with ``seq.commit(k)``. ``parents`` (a tree of drafts after the pending token ``ids[0]``: ``parents[i]``
is the index of draft i's parent among the drafts, -1 for the pending token): each draft attends to the committed
prefix and its own ancestors at position ``start + depth``; its K/V are written at slot ``start + 1 + i`` (move
the accepted path into place with ``PagedKVCache.move`` before committing it). ``cancel``: once set, the pass stops
before its next decoder layer with :class:`~specchat.backend.kv.attention.PassCancelled` (the eager and compact
paths; a graph replay or a native pass runs to its end).

The paths:
- :class:`NativePath`: the CPU default, the whole pass in C++ on the file's own blocks
  (``backend/kernels/native_model.py``); every tap but the embeddings.
- :class:`GraphPath`: CUDA graphs over static shapes (``backend/kernels/cuda_graphs.py``); a step the graphs
  decline (a tree, taps, too many tokens, a key length beyond the buckets) runs eagerly, with the same result.
- :class:`CompactPath`: what a CPU without a C++ compiler runs for a llama-family Q4_0/Q4_1 file
  (``quantization: int4-torch``, ``backend/kernels/compact.py``): int4 layers in a torch loop.
- :class:`EagerPath`: transformers' own forward with paged attention (``backend/kv/attention.py``); on CPU a float
  model's linear layers are packed for oneDNN at load when the copy fits (``backend/kernels/cpu_linear.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import compact, cuda_graphs
from specchat.backend.kernels.native_model import NativeModel, PassPart
from specchat.backend.kv import attention
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import Sequence

Taps = tuple[int, ...]


@dataclass(frozen=True)
class Pass:
    """What one forward gives: ``logits`` [keep, vocab] float; ``hidden`` [n, len(taps) * hidden] float32, the
    residual stream at the taps asked for, side by side in their order (None when none were asked for)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class ForwardPath(Protocol):
    @property
    def name(self) -> str: ...  # "cpu-native", "cuda-graphs", "cpu-compact", "cpu-packed" or "eager"

    def run(
        self,
        seq: Sequence,
        ids: torch.Tensor,
        keep: int,
        parents: list[int] | None,
        cancel: threading.Event | None,
        taps: Taps | None,
    ) -> Pass: ...


def checked_ids(
    seq: Sequence, input_ids: list[int] | torch.Tensor, keep: Any, parents: list[int] | None
) -> torch.Tensor:
    """``input_ids`` as a long tensor [n] on the cache's device, after checking the pass's arguments."""
    device = seq.cache.device
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.reshape(-1).to(device=device, dtype=torch.long)
    else:
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    n = ids.numel()
    if n < 1:
        raise KVCacheUsageError("forward: input_ids is empty")
    if not isinstance(keep, int) or not 1 <= keep <= n:
        raise KVCacheUsageError(f"forward: logits_to_keep must be in 1..{n} (the new tokens), got {keep!r}")
    if parents is not None and len(parents) != n - 1:
        raise KVCacheUsageError(f"forward: {n} tokens need {n - 1} parents (one per draft), got {len(parents)}")
    return ids


def check_taps(taps: Taps, config: Any) -> None:
    """Refuse tap indices the model does not have. A tap index is transformers' ``output_hidden_states`` index:
    ``i`` in ``0 .. L-1`` is the residual stream entering decoder layer ``i`` (0: the embeddings), ``L`` (the
    number of layers) the final normed hidden state, what the LM head reads. EAGLE-3 reads three of them
    (low, middle, high), EAGLE and Medusa the last."""
    layers = int(config.num_hidden_layers)
    bad = [t for t in taps if not (isinstance(t, int) and 0 <= t <= layers)]
    if bad or not taps:
        raise KVCacheUsageError(f"forward: taps {list(taps)} must be 1+ indices in 0..{layers} (the layers)")


class NativePath:
    name = "cpu-native"

    def __init__(self, model: Any, native: NativeModel) -> None:
        self.config, self.native = model.config, native

    def native_taps(self, taps: Taps) -> Taps:
        """:func:`check_taps`' indices as the native model's: its tap ``l`` is the stream *after* layer ``l`` (the
        one entering layer ``l + 1``), its tap ``L`` the final norm's output, as here; the embeddings (0) it has
        not."""
        layers = int(self.config.num_hidden_layers)
        if 0 in taps:
            raise ModelLoadError(
                "a draft head reading the embeddings (tap 0) needs the transformers forward; the CPU native model "
                "taps the layers' outputs only"
            )
        return tuple(layers if t == layers else t - 1 for t in taps)

    def run(self, seq, ids, keep, parents, cancel, taps) -> Pass:
        logits, tapped = self.native.forward(seq, ids, keep, parents, self.native_taps(taps) if taps else ())
        return Pass(logits, torch.cat(tapped, dim=1) if taps else None)

    def run_batch(self, parts: list[PassPart], taps: Taps | None) -> list[Pass]:
        """Several sequences' rows in one native pass, each part's Pass what :meth:`run` gives it alone."""
        out = self.native.forward_batch(parts, self.native_taps(taps) if taps else ())
        return [Pass(logits, torch.cat(tapped, dim=1) if taps else None) for logits, tapped in out]


class EagerPath:
    """transformers' forward over the paged cache; ``fast`` (a :class:`CompactPath`'s loop) replaces it."""

    def __init__(self, model: Any, packed_layers: int = 0) -> None:
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != attention.ATTN_IMPLEMENTATION:
            raise ModelLoadError(
                f"the paged forward needs a model with attn_implementation={attention.ATTN_IMPLEMENTATION!r}, this "
                f"one uses {impl!r}: load it with that name after attention.register(), or call "
                "use_paged_attention(model)"
            )
        self.model, self.packed_layers = model, packed_layers

    @property
    def name(self) -> str:
        return "cpu-packed" if self.packed_layers else "eager"

    def context(
        self, seq: Sequence, n: int, parents: list[int] | None, cancel: threading.Event | None
    ) -> tuple[attention.PagedContext, torch.Tensor]:
        """Reserve ``n`` rows after ``seq``'s committed tokens: their attention context and positions."""
        seq.reserve(n)
        plan = seq.plan(n)
        if parents is None:
            return attention.PagedContext(seq.cache, plan, cancel=cancel), torch.arange(
                plan.start, plan.kv_len, device=seq.cache.device
            )
        depths, visible = attention.tree_tensors(parents, seq.cache.device)
        return attention.PagedContext(seq.cache, plan, tree=(depths, visible), cancel=cancel), plan.start + depths

    def run(self, seq, ids, keep, parents, cancel, taps) -> Pass:
        ctx, positions = self.context(seq, ids.numel(), parents, cancel)
        extra = {} if taps is None else {"output_hidden_states": True}
        with torch.inference_mode():
            out = self.model(
                input_ids=ids[None],
                position_ids=positions[None],
                use_cache=False,
                paged=ctx,
                logits_to_keep=keep,
                **extra,
            )
        if taps is None:
            return Pass(out.logits[0].float())
        return Pass(out.logits[0].float(), torch.cat([out.hidden_states[t][0].float() for t in taps], dim=1))


class CompactPath(EagerPath):
    """The int4 torch loop (``backend/kernels/compact.py``) over the same paged context as :class:`EagerPath`."""

    def __init__(self, model: Any, fast: compact.CompactForward) -> None:
        super().__init__(model)
        self.fast = fast

    @property
    def name(self) -> str:
        return "cpu-compact"

    def run(self, seq, ids, keep, parents, cancel, taps) -> Pass:
        ctx, positions = self.context(seq, ids.numel(), parents, cancel)
        if taps is None:
            return Pass(self.fast(ids, positions, ctx, keep))
        logits, hidden = self.fast.tapped(ids, positions, ctx, keep, taps)
        return Pass(logits, hidden)


class GraphPath(EagerPath):
    """CUDA graphs for the chain steps they take; every other step eagerly."""

    def __init__(self, model: Any, graphs: cuda_graphs.GraphRunner) -> None:
        super().__init__(model)
        self.graphs = graphs

    @property
    def name(self) -> str:
        return "cuda-graphs" if self.graphs.disabled_reason is None else "eager"

    def run(self, seq, ids, keep, parents, cancel, taps) -> Pass:
        if parents is None and taps is None:
            replayed = self.graphs.try_forward(seq, ids, keep)
            if replayed is not None:
                return Pass(replayed)
        return super().run(seq, ids, keep, parents, cancel, taps)


def forward_paged(
    path: ForwardPath,
    seq: Sequence,
    input_ids: list[int] | torch.Tensor,
    *,
    logits_to_keep: int = 1,
    parents: list[int] | None = None,
    cancel: threading.Event | None = None,
    taps: Taps | None = None,
    config: Any = None,
) -> Pass:
    """One forward of ``path`` (see the module docstring), after checking its arguments (``config``: the model's,
    to check ``taps`` against)."""
    if taps is not None and config is not None:
        check_taps(taps, config)
    ids = checked_ids(seq, input_ids, logits_to_keep, parents)
    return path.run(seq, ids, logits_to_keep, parents, cancel, taps)
