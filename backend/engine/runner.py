"""The model runner: the one place that decides how a model's forward over the paged cache runs.

Contract:
- :class:`ModelRunner` takes a loaded model, sizes its :class:`~specchat.backend.kv.kv_cache.PagedKVCache` and
  chooses the path for its device, once. On CPU the native model (``backend/kernels/native_model.py``: the whole
  pass in C++ on the file's own blocks) runs whenever the library is usable here and the architecture is
  covered; that choice is made when the model loads (``backend/models/native_loading.py``: it decides how the
  weights are read), and a model loaded for it is a ``NativeCausalLM``, which has no other path. Otherwise the
  model is switched to paged attention (``backend/kv/attention.py``) and runs: CUDA graphs over static shapes on
  CUDA (``backend/kernels/cuda_graphs.py``; ``SPECCHAT_CUDA_GRAPHS=0`` turns them off); on CPU, for a model with
  int4/int8 layers (``quantization: int4-torch | int8-torch``, the fallback for llama-family Q4_0 / Q4_1 files
  without a compiler) the compact forward (``backend/kernels/compact.py``; ``SPECCHAT_COMPACT=0`` turns it off,
  and an architecture it does not cover keeps transformers' forward), for a float32 model oneDNN-packed linear
  layers when their second copy fits in free memory (``backend/kernels/cpu_linear.py``; ``SPECCHAT_CPU_PACKED=0``
  turns it off); else the plain eager forward. A light model (``backend/models/skeleton.py``, loaded for the
  compact forward) has no other path: without it the runner raises :class:`ModelLoadError`.
- :attr:`ModelRunner.start_line` names the path in one line ("CPU native (avx2), Q4_1, Q8_0 as stored"; on a fallback,
  why the native model does not run, the line the UI, ``generate`` and ``serve`` show).
- :meth:`ModelRunner.forward` runs one forward over ``input_ids`` appended after ``seq``'s committed tokens and
  returns the float logits of the last ``logits_to_keep`` of them. It reserves their cache slots but does NOT
  commit: the caller keeps what it accepts with ``seq.commit(k)``. A step the graph path declines (too many
  tokens, a key length beyond its buckets) runs eagerly, with the same result.
- :meth:`ModelRunner.forward_batch` runs several sequences' passes (each a ``PassPart``) together: one pass over all
  their rows on the native model, one forward each on the other paths; each part's result is what ``forward``
  gives it alone.
- :meth:`ModelRunner.forward_taps` also returns the residual stream after the layers asked for, for every row
  (the native model only; draft heads read them).
- :func:`forward_paged` is that forward for a model switched to paged attention by hand (tests), eager unless
  given a graph runner, a compact forward or a native model.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import compact, cpu_linear, cuda_graphs, native, quant_linear, switched_off
from specchat.backend.kernels.native_model import NativeModel, PassPart
from specchat.backend.kv import attention
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import PagedKVCache, Sequence
from specchat.backend.limits import KV_BLOCK_SIZE, MAX_GAMMA
from specchat.backend.models.loading import LoadedModel
from specchat.backend.models.memory import format_bytes, free_memory
from specchat.backend.models.native_loading import NativeCausalLM
from specchat.backend.models.skeleton import LightCausalLM

PACKING_SPARE_BYTES = 512 * 2**20  # free memory left after packing (activations of a prefill chunk, the UI)

log = logging.getLogger(__name__)


def forward_paged(
    model,
    seq: Sequence,
    input_ids: list[int] | torch.Tensor,
    *,
    logits_to_keep: int = 1,
    graphs: cuda_graphs.GraphRunner | None = None,
    fast: compact.CompactForward | None = None,
    parents: list[int] | None = None,
    cancel: threading.Event | None = None,
    native_model: NativeModel | None = None,
    taps: tuple[int, ...] | None = None,
) -> Any:  # [logits_to_keep, vocab] float; with taps: (that, [n, len(taps) * hidden] float32)
    """One forward over ``input_ids`` appended after ``seq``'s committed tokens; does not commit. The native
    model when given, else the static forward of ``graphs`` when given and it takes the step, else the compact
    forward ``fast`` when given, else the model's own.

    ``parents`` (a tree of drafts after the pending token ``input_ids[0]``: ``parents[i]`` is the index of draft
    i's parent among the drafts, -1 for the pending token): each draft attends to the committed prefix and its
    own ancestors at position ``start + depth``; its K/V are written at slot ``start + 1 + i`` (move the accepted
    path into place with ``PagedKVCache.move`` before committing it). Graph runners decline trees; the compact
    forward and the model's own take them.

    ``cancel``: when it is set, the pass stops before its next decoder layer with
    :class:`~specchat.backend.kv.attention.PassCancelled` (the compact forward's and the model's own; a graph
    replay or a native pass runs to its end); a pass that completes is unchanged by it.

    ``taps`` (hidden-state taps, see :func:`check_taps`): also return the residual stream at those points for
    every row of the pass, ``[n, len(taps) * hidden]`` float32, side by side in the order given; the logits are
    the same as without taps. Graph runners decline taps; the native model takes every tap but the embeddings."""
    if taps is not None:
        check_taps(taps, model.config)
    if native_model is not None:
        if taps is None:
            return forward_taps(native_model, seq, input_ids, logits_to_keep=logits_to_keep, parents=parents)[0]
        logits, tapped = forward_taps(
            native_model, seq, input_ids, logits_to_keep=logits_to_keep, parents=parents, taps=native_taps(taps, model)
        )
        return logits, torch.cat(tapped, dim=1)
    if graphs is not None and parents is None and taps is None and isinstance(logits_to_keep, int):
        n = input_ids.numel() if isinstance(input_ids, torch.Tensor) else len(input_ids)
        if 1 <= logits_to_keep <= n:
            replayed = graphs.try_forward(seq, input_ids, logits_to_keep)
            if replayed is not None:
                return replayed
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != attention.ATTN_IMPLEMENTATION:
        raise ModelLoadError(
            f"forward_paged needs a model with attn_implementation={attention.ATTN_IMPLEMENTATION!r}, this one "
            f"uses {impl!r}: load it with that name after attention.register(), or call use_paged_attention(model)"
        )
    ids = _checked_ids(seq, input_ids, logits_to_keep, parents)
    n, device = ids.numel(), seq.cache.device
    seq.reserve(n)
    plan = seq.plan(n)
    if parents is None:
        ctx = attention.PagedContext(seq.cache, plan, cancel=cancel)
        positions = torch.arange(plan.start, plan.kv_len, device=device)
    else:
        depths, visible = attention.tree_tensors(parents, device)
        ctx = attention.PagedContext(seq.cache, plan, tree=(depths, visible), cancel=cancel)
        positions = plan.start + depths
    if fast is not None:
        return (
            fast(ids, positions, ctx, logits_to_keep)
            if taps is None
            else fast.tapped(ids, positions, ctx, logits_to_keep, taps)
        )
    extra = {} if taps is None else {"output_hidden_states": True}
    with torch.inference_mode():
        out = model(
            input_ids=ids[None],
            position_ids=positions[None],
            use_cache=False,
            paged=ctx,
            logits_to_keep=logits_to_keep,
            **extra,
        )
    if taps is None:
        return out.logits[0].float()
    return out.logits[0].float(), torch.cat([out.hidden_states[t][0].float() for t in taps], dim=1)


def check_taps(taps: tuple[int, ...], config: Any) -> None:
    """Refuse tap indices the model does not have. A tap index is transformers' ``output_hidden_states`` index:
    ``i`` in ``0 .. L-1`` is the residual stream entering decoder layer ``i`` (0: the embeddings), ``L`` (the
    number of layers) the final normed hidden state, what the LM head reads. EAGLE-3 reads three of them
    (low, middle, high), EAGLE and Medusa the last."""
    layers = int(config.num_hidden_layers)
    bad = [t for t in taps if not (isinstance(t, int) and 0 <= t <= layers)]
    if bad or not taps:
        raise KVCacheUsageError(f"forward_paged: taps {list(taps)} must be 1+ indices in 0..{layers} (the layers)")


def native_taps(taps: tuple[int, ...], model: Any) -> tuple[int, ...]:
    """:func:`check_taps`' indices as the native model's: its tap ``l`` is the stream *after* layer ``l`` (the one
    entering layer ``l + 1``), its tap ``L`` the final norm's output, as here; the embeddings (0) it has not."""
    layers = int(model.config.num_hidden_layers)
    if 0 in taps:
        raise ModelLoadError(
            "a draft head reading the embeddings (tap 0) needs the transformers forward; the CPU native model "
            "taps the layers' outputs only"
        )
    return tuple(layers if t == layers else t - 1 for t in taps)


def _checked_ids(seq: Sequence, input_ids, logits_to_keep, parents: list[int] | None) -> torch.Tensor:
    """``input_ids`` as a long tensor [n] on the cache's device, after checking the pass's arguments."""
    device = seq.cache.device
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.reshape(-1).to(device=device, dtype=torch.long)
    else:
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    n = ids.numel()
    if n < 1:
        raise KVCacheUsageError("forward_paged: input_ids is empty")
    if not isinstance(logits_to_keep, int) or not 1 <= logits_to_keep <= n:
        raise KVCacheUsageError(
            f"forward_paged: logits_to_keep must be in 1..{n} (the new tokens), got {logits_to_keep!r}"
        )
    if parents is not None and len(parents) != n - 1:
        raise KVCacheUsageError(f"forward_paged: {n} tokens need {n - 1} parents (one per draft), got {len(parents)}")
    return ids


def forward_taps(
    native_model: NativeModel,
    seq: Sequence,
    input_ids: list[int] | torch.Tensor,
    *,
    logits_to_keep: int = 1,
    parents: list[int] | None = None,
    taps: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # ([logits_to_keep, vocab] float32, [[n, hidden] float32] per tap)
    """The native model's pass (as :func:`forward_paged`), with the residual stream after the layers ``taps``
    (``num_layers``: the final norm's output) for every row."""
    ids = _checked_ids(seq, input_ids, logits_to_keep, parents)
    return native_model.forward(seq, ids, logits_to_keep, parents, taps)


class ModelRunner:
    """One model with its paged cache and its chosen forward path (see the module docstring).

    ``kv_tokens`` sizes the cache (the engine passes the context length plus room for a verification step), the
    longest sequence a pass reads; ``kept_tokens`` more slots hold sequences kept between requests (the engine's
    prefix cache), so the pool grows by them while a pass's key length (the CUDA graphs' buckets) does not.
    """

    def __init__(self, loaded: LoadedModel, *, kv_tokens: int, kept_tokens: int = 0) -> None:
        model = loaded.model
        self.loaded = loaded
        self.graphs: cuda_graphs.GraphRunner | None = None
        self.compact: compact.CompactForward | None = None
        self.packed_layers = 0
        self.native: NativeModel | None = None
        self.taps_required = False  # require_taps(): a draft head reads hidden states from every pass
        if isinstance(model, NativeCausalLM):  # the whole pass in C++: nothing of transformers is involved
            self.cache = PagedKVCache.for_model(
                model.config,
                max_tokens=kv_tokens + kept_tokens,
                block_size=KV_BLOCK_SIZE,
                dtype=loaded.dtype,
                device=loaded.device,
            )
            model.native.bind(self.cache)
            self.native = model.native
            return
        attention.check_supported(model.config)
        light = isinstance(model, LightCausalLM)  # its config names the paged attention; registering it with
        # transformers would import transformers' modelling code, which only a transformers forward needs
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION if light else attention.register())
        model.eval()
        wants_graphs = cuda_graphs.graphs_wanted(loaded.device)
        # The graph runner keeps one block of its own for the K/V of padded tokens.
        self.cache = PagedKVCache.for_model(
            model.config,
            max_tokens=kv_tokens + kept_tokens + (KV_BLOCK_SIZE if wants_graphs else 0),
            block_size=KV_BLOCK_SIZE,
            dtype=loaded.dtype,
            device=loaded.device,
        )
        if wants_graphs:
            self.graphs = cuda_graphs.GraphRunner(model, self.cache, max_kv=kv_tokens)
        elif loaded.device.type == "cpu" and quant_linear.quantized_layers(model):
            self.compact = _compact_forward(loaded)
        elif loaded.device.type == "cpu":
            self.packed_layers = _pack_if_it_fits(loaded)
        if light and self.compact is None:
            raise ModelLoadError(
                f"{loaded.spec.source} was loaded for the compact forward on CPU, which is not "
                f"available now (SPECCHAT_COMPACT={os.environ.get('SPECCHAT_COMPACT', '')!r}, device "
                f"{loaded.device}); load the model again in this setting"
            )

    @property
    def model(self):
        return self.loaded.model

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def path(self) -> str:
        """The forward path in use: "cpu-native", "cuda-graphs", "cpu-compact", "cpu-packed" or "eager"."""
        if self.native is not None:
            return "cpu-native"
        if self.graphs is not None and self.graphs.disabled_reason is None:
            return "cuda-graphs"
        if self.compact is not None:
            return "cpu-compact"
        return "cpu-packed" if self.packed_layers else "eager"

    @property
    def exact_rows(self) -> int:
        """The most tokens a pass may hold with every row's logits what a one-token pass gives, bit for bit:
        the compact forward's row-wise attention (and its C++ layers) take ``compact.ROWWISE_ROWS``; the CUDA
        graphs' largest bucket and the eager paths are held to ``MAX_GAMMA + 1`` (what they are tested at)."""
        return compact.ROWWISE_ROWS if self.path == "cpu-compact" else MAX_GAMMA + 1

    def forward(
        self,
        seq: Sequence,
        input_ids: list[int] | torch.Tensor,
        *,
        logits_to_keep: int = 1,
        parents: list[int] | None = None,
        cancel: threading.Event | None = None,
        taps: tuple[int, ...] | None = None,
    ) -> Any:  # [logits_to_keep, vocab] float; with taps: (that, [n, len(taps) * hidden] float32)
        """One forward over ``input_ids`` after ``seq``'s committed tokens (reserves, writes, never commits);
        ``parents``: a tree of drafts; ``cancel``: stop between layers once set; ``taps``: hidden states to return
        too (see :func:`forward_paged`)."""
        return forward_paged(
            self.model,
            seq,
            input_ids,
            logits_to_keep=logits_to_keep,
            graphs=self.graphs,
            fast=self.compact,
            parents=parents,
            cancel=cancel,
            native_model=self.native,
            taps=taps,
        )

    def forward_batch(self, parts: list[PassPart], taps: tuple[int, ...] | None = None) -> list[Any]:
        """Several sequences' passes at once, each part's result what :meth:`forward` gives it alone: one pass over
        all rows on the native model (weights read once), else one forward per part (``offset`` native only)."""
        if self.native is not None:
            if taps is not None:
                check_taps(taps, self.model.config)
            for part in parts:
                _checked_ids(part.seq, part.ids, part.keep, part.parents)
            out = self.native.forward_batch(parts, () if taps is None else native_taps(taps, self.model))
            return [logits if taps is None else (logits, torch.cat(tapped, dim=1)) for logits, tapped in out]
        if any(part.offset for part in parts):
            raise KVCacheUsageError(f"a pass in pieces needs the CPU native model; this model runs {self.path}")
        return [
            self.forward(part.seq, part.ids, logits_to_keep=part.keep, parents=part.parents, taps=taps)
            for part in parts
        ]

    def require_taps(self) -> bool:
        """Every pass of this runner may ask for taps from now on (a draft head reads them). Every path returns
        them from the pass it would run anyway (the native model, the compact loop, transformers; CUDA graphs
        stay for passes without taps, whose result is the eager forward's), so nothing cached is dropped: False."""
        self.taps_required = True
        return False

    def forward_taps(
        self,
        seq: Sequence,
        input_ids: list[int] | torch.Tensor,
        *,
        taps: tuple[int, ...],
        logits_to_keep: int = 1,
        parents: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`forward` plus the residual stream after the layers ``taps`` for every row (see
        :func:`forward_taps`); the native model only, else :class:`ModelLoadError` naming the path in use."""
        if self.native is None:
            raise ModelLoadError(f"hidden-state taps need the CPU native model; this model runs {self.path}")
        return forward_taps(
            self.native, seq, input_ids, logits_to_keep=logits_to_keep, parents=parents, taps=tuple(taps)
        )

    @property
    def start_line(self) -> str:
        """The path in one line (see the module docstring)."""
        model, reason = self.loaded.model, self.loaded.native_reason
        if isinstance(model, NativeCausalLM):
            return f"CPU native ({native.isa()}), {model.description}"
        if self.path == "cuda-graphs":
            return f"CUDA graphs on {self.device}"
        where = {
            "cpu-compact": "CPU int4 Python loop",
            "cpu-packed": "CPU transformers forward (oneDNN-packed)",
        }.get(self.path, f"transformers forward on {self.device}")
        return f"{where}: {reason}" if reason else where

    def close(self) -> None:
        """Release the CUDA graphs (their memory pool) and their block."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None


def _pack_if_it_fits(loaded: LoadedModel) -> int:
    """On CPU, pack the linear layers for oneDNN when their second copy fits in free memory with room to spare
    for a prefill's activations; otherwise decode with the default kernels, and log why. Returns layers packed."""
    need = cpu_linear.packed_bytes(loaded.model)
    if not need:
        return 0
    free = free_memory(torch.device("cpu"))
    if need + PACKING_SPARE_BYTES > free:
        log.info(
            "not packing %s's linear layers for oneDNN: %s needed, %s free",
            loaded.spec.source,
            format_bytes(need),
            format_bytes(free),
        )
        return 0
    count = cpu_linear.pack_linears(loaded.model)
    if count:
        log.info("packed %d linear layers of %s for oneDNN (%s)", count, loaded.spec.source, format_bytes(need))
    return count


def _compact_forward(loaded: LoadedModel) -> compact.CompactForward | None:
    """The compact forward of a quantised model on CPU, unless switched off or its architecture is not covered."""
    if switched_off("SPECCHAT_COMPACT"):
        return None
    try:
        return compact.build(loaded.model)
    except compact.Unsupported as reason:
        log.info("%s runs transformers' forward: the compact forward does not cover %s", loaded.spec.source, reason)
        return None
