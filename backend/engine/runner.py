"""The model runner: the one place that decides how a model's forward over the paged cache runs.

Contract:
- :class:`ModelRunner` takes a loaded model, switches it to paged attention (``backend/kv/attention.py``),
  sizes its :class:`~specchat.backend.kv.kv_cache.PagedKVCache` and chooses the path for its device, once:
  CUDA graphs over static shapes on CUDA (``backend/kernels/cuda_graphs.py``; ``SPECCHAT_CUDA_GRAPHS=0`` turns
  them off); on CPU, for a model with int4/int8 layers (``quantization: int4-torch | int8-torch``) the
  compact forward (``backend/kernels/compact.py``; ``SPECCHAT_COMPACT=0`` turns it off, and an architecture it
  does not cover keeps transformers' forward; its decoder layers move to C++ once built for this machine and
  adopted between requests (:meth:`ModelRunner.adopt_native`), ``backend/kernels/native.py``,
  ``SPECCHAT_NATIVE=0`` turns that off), for a float32 model oneDNN-packed linear
  layers when their second copy fits in free memory (``backend/kernels/cpu_linear.py``; ``SPECCHAT_CPU_PACKED=0``
  turns it off); else the plain eager forward. A light model (``backend/models/skeleton.py``, loaded for the
  compact forward) has no other path: without it the runner raises :class:`ModelLoadError`.
- :meth:`ModelRunner.forward` runs one forward over ``input_ids`` appended after ``seq``'s committed tokens and
  returns the float logits of the last ``logits_to_keep`` of them. It reserves their cache slots but does NOT
  commit: the caller keeps what it accepts with ``seq.commit(k)``. A step the graph path declines (too many
  tokens, a key length beyond its buckets) runs eagerly, with the same result.
- :func:`forward_paged` is that forward for a model switched to paged attention by hand (tests), eager unless
  given a graph runner or a compact forward.
"""

from __future__ import annotations

import logging
import os

import torch

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import compact, cpu_linear, cuda_graphs, native, quant_linear, switched_off
from specchat.backend.kv import attention
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import PagedKVCache, Sequence
from specchat.backend.limits import KV_BLOCK_SIZE, MAX_GAMMA
from specchat.backend.models.loading import LoadedModel
from specchat.backend.models.memory import format_bytes, free_memory
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
) -> torch.Tensor:  # [logits_to_keep, vocab] float
    """One forward over ``input_ids`` appended after ``seq``'s committed tokens; does not commit. The static
    forward of ``graphs`` when given and it takes the step, else the compact forward ``fast`` when given,
    else the model's own.

    ``parents`` (a tree of drafts after the pending token ``input_ids[0]``: ``parents[i]`` is the index of draft
    i's parent among the drafts, -1 for the pending token): each draft attends to the committed prefix and its
    own ancestors at position ``start + depth``; its K/V are written at slot ``start + 1 + i`` (move the accepted
    path into place with ``PagedKVCache.move`` before committing it). Graph runners decline trees; the compact
    forward and the model's own take them."""
    if graphs is not None and parents is None and isinstance(logits_to_keep, int):
        n = input_ids.numel() if isinstance(input_ids, torch.Tensor) else len(input_ids)
        if 1 <= logits_to_keep <= n:
            logits = graphs.try_forward(seq, input_ids, logits_to_keep)
            if logits is not None:
                return logits
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != attention.ATTN_IMPLEMENTATION:
        raise ModelLoadError(
            f"forward_paged needs a model with attn_implementation={attention.ATTN_IMPLEMENTATION!r}, this one "
            f"uses {impl!r}: load it with that name after attention.register(), or call use_paged_attention(model)"
        )
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
    seq.reserve(n)
    plan = seq.plan(n)
    if parents is None:
        ctx = attention.PagedContext(seq.cache, plan)
        positions = torch.arange(plan.start, plan.kv_len, device=device)
    else:
        depths, visible = attention.tree_tensors(parents, device)
        ctx = attention.PagedContext(seq.cache, plan, tree=(depths, visible))
        positions = plan.start + depths
    if fast is not None:
        return fast(ids, positions, ctx, logits_to_keep)
    with torch.inference_mode():
        out = model(
            input_ids=ids[None], position_ids=positions[None], use_cache=False, paged=ctx, logits_to_keep=logits_to_keep
        )
    return out.logits[0].float()


class ModelRunner:
    """One model with its paged cache and its chosen forward path (see the module docstring).

    ``kv_tokens`` sizes the cache (the engine passes the context length plus room for a verification step).
    """

    def __init__(self, loaded: LoadedModel, *, kv_tokens: int) -> None:
        model = loaded.model
        attention.check_supported(model.config)
        light = isinstance(model, LightCausalLM)  # its config names the paged attention; registering it with
        # transformers would import transformers' modelling code, which only a transformers forward needs
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION if light else attention.register())
        model.eval()
        self.loaded = loaded
        self.graphs: cuda_graphs.GraphRunner | None = None
        self.compact: compact.CompactForward | None = None
        self.packed_layers = 0
        self.native: native.Attachment | None = None
        wants_graphs = cuda_graphs.graphs_wanted(loaded.device)
        # The graph runner keeps one block of its own for the K/V of padded tokens.
        self.cache = PagedKVCache.for_model(
            model.config,
            max_tokens=kv_tokens + (KV_BLOCK_SIZE if wants_graphs else 0),
            block_size=KV_BLOCK_SIZE,
            dtype=loaded.dtype,
            device=loaded.device,
        )
        if wants_graphs:
            self.graphs = cuda_graphs.GraphRunner(model, self.cache, max_kv=kv_tokens)
        elif loaded.device.type == "cpu" and quant_linear.quantized_layers(model):
            self.compact = _compact_forward(loaded)
            if self.compact is not None:  # its C++ layers, in the background (built once per machine)
                self.native = native.attach(self.compact, self.cache, loaded.spec.source)
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
        """The forward path in use: "cuda-graphs", "cpu-compact", "cpu-packed" or "eager"."""
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
    ) -> torch.Tensor:  # [logits_to_keep, vocab] float
        """One forward over ``input_ids`` after ``seq``'s committed tokens (reserves, writes, never commits);
        ``parents``: a tree of drafts (see :func:`forward_paged`)."""
        return forward_paged(
            self.model,
            seq,
            input_ids,
            logits_to_keep=logits_to_keep,
            graphs=self.graphs,
            fast=self.compact,
            parents=parents,
        )

    def adopt_native(self) -> bool:
        """Between requests: switch to the native decoder layers if they became ready since the last call; True
        when this call switched (K/V cached before then came from the Python loop: the caller drops them)."""
        return self.native is not None and self.native.adopt()

    def close(self) -> None:
        """Release the CUDA graphs (their memory pool) and their block, and the native layers' hold on the
        weights and cache."""
        if self.native is not None:
            self.native.close()
            self.native = None
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
