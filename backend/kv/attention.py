"""The transformers attention adapter over the paged KV cache: the only module that knows that API. It only attends.

Contract:
- :func:`register` adds the attention function ``ATTN_IMPLEMENTATION`` to ``transformers.AttentionInterface``
  (idempotent). A model loaded with ``attn_implementation=ATTN_IMPLEMENTATION`` (or switched with
  :func:`use_paged_attention`) is then run only by the model runner (``backend/engine/runner.py``), which
  calls it with ``use_cache=False``, explicit positions and a per-forward :class:`PagedContext` as the
  ``paged`` kwarg.
- Every attention layer writes its new K/V into their slots (the context's slot plan) and attends causally over
  the sequence (query ``i`` sees keys ``<= start + i``), within ``sliding_window`` keys (``q - k < window``, as
  transformers' masks) when the layer has one, and with ``softcap`` (tanh logit capping, :func:`softcapped`)
  when the model asks for it.
- No mask function is registered with ``AttentionMaskInterface``, on purpose: for an implementation absent
  from that registry transformers skips mask preparation entirely (``_preprocess_mask_arguments`` exits
  early), whereas a registered one, even returning None, first runs packed-sequence detection, a host sync
  that costs time per forward and breaks CUDA-graph capture. Masks are built here, once per forward and
  window size, and only when SDPA cannot do without (q > 1 after a prefix, or a window cutting the query).
- Static mode (``backend/kernels/cuda_graphs.py``): a forward with fixed-shape buffers passes a context of
  its own instead of a :class:`PagedContext`, and the attention function hands each layer to it
  (``ctx.attend``); it uses :func:`softcapped` for softcapped layers too.
- :func:`check_supported` raises :class:`ModelLoadError` for architectures or attention features this
  adapter does not honour (bidirectional attention, chunked/linear layers, attention sinks).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
import torch.nn.functional as F

from specchat.backend.errors import ModelLoadError
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import PagedKVCache, SlotPlan

ATTN_IMPLEMENTATION = "specchat_paged"

# model_type -> what it covers. Each is tested on a tiny random model against the stock attention.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama, SmolLM",
    "mistral": "Mistral (sliding window)",
    "qwen2": "Qwen2 / Qwen2.5 (qkv bias, optional sliding window)",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2 (logit softcapping, alternating sliding-window layers)",
    "gemma3_text": "Gemma 3 text models (alternating local / global layers)",
    "gemma3": "Gemma 3 multimodal checkpoints, text only",
    "phi3": "Phi-3 / Phi-3.5 / Phi-4-mini",
}
_LAYER_TYPES = {"full_attention", "sliding_attention"}


class AttentionModule(Protocol):
    """What :func:`paged_attention_forward` reads of the attention layer calling it (transformers' layer, or the
    compact forward's on its behalf)."""

    layer_idx: int
    head_dim: int


def _supported_list() -> str:
    return "; ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())


def check_supported(config) -> None:
    """Raise :class:`ModelLoadError` unless paged attention honours everything this config's attention does."""
    model_type = getattr(config, "model_type", None)
    archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {model_type!r} ({archs}) is not supported by specchat's paged attention. "
            f"Supported model types: {_supported_list()}. Pick a model of one of these families."
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "use_bidirectional_attention", False) or not getattr(text, "is_causal", True):
        raise ModelLoadError(
            f"{model_type!r} model is configured for bidirectional attention (an embedding model?); "
            "specchat decodes with causal attention only. Pick a causal (chat/instruct) checkpoint."
        )
    odd = sorted(set(getattr(text, "layer_types", None) or []) - _LAYER_TYPES)
    if odd:
        raise ModelLoadError(
            f"{model_type!r} model has layer types {odd} that specchat's paged attention does not implement "
            f"(it implements {sorted(_LAYER_TYPES)}). Pick a model without them."
        )


def tree_tensors(parents: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``tree`` of a :class:`PagedContext` for a pass over the pending token and a tree of drafts:
    ``parents[i]`` is draft i's parent among the drafts (-1: the pending token), parents before children.
    Returns ``depths`` [1 + len(parents)] (the pending token at depth 0) and ``visible`` [n, n]."""
    n = 1 + len(parents)
    depth = [0] * n
    visible = [[False] * n for _ in range(n)]
    visible[0][0] = True
    for i, parent in enumerate(parents, start=1):
        above = parent + 1  # the pending token is row 0
        if not 0 <= above < i:
            raise KVCacheUsageError(f"tree_tensors: draft {i - 1}'s parent {parent} is not an earlier draft or -1")
        depth[i] = depth[above] + 1
        visible[i] = list(visible[above])
        visible[i][i] = True
    return (
        torch.tensor(depth, dtype=torch.long, device=device),
        torch.tensor(visible, dtype=torch.bool, device=device),
    )


class PagedContext:
    """Per-forward state shared by all layers: the cache, the slot plan and the masks (built lazily, once).

    ``tree`` (a tree of drafts verified in one pass): ``(depths, visible)``, ``depths`` long ``[num_new]`` (the
    new tokens' positions are ``start + depths``) and ``visible`` bool ``[num_new, num_new]``, True where new token
    i may see new token j (j is i or one of its ancestors). Every new token sees the whole committed prefix.
    """

    __slots__ = ("cache", "plan", "tree", "cancel", "_layouts")

    def __init__(
        self,
        cache: PagedKVCache,
        plan: SlotPlan,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.cache = cache
        self.plan = plan
        self.tree = tree
        self.cancel = cancel  # set: the pass stops at its next layer (check_cancel), nothing of it is kept
        self._layouts: dict[tuple[int | None, bool], tuple[int, torch.Tensor | None, bool]] = {}

    def layout(self, window: int | None, explicit: bool) -> tuple[int, torch.Tensor | None, bool]:
        """(first key position read, mask, is_causal) for a layer with ``window`` (None = full attention).

        The mask is bool ``[num_new, kv_len - first]``, True where a query may attend (SDPA), or, with
        ``explicit`` (the softcap path), True where it may NOT (for ``masked_fill``); None when no key has to
        be hidden or SDPA's ``is_causal`` does it.
        """
        key = (window, explicit)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        p = self.plan
        n, start, kv_len = p.num_new, p.start, p.kv_len
        # Keys older than every query's window are not read at all (a shorter slice, fewer FLOPs).
        first = 0 if window is None else max(0, start - window + 1)
        mask, causal = None, False
        if self.tree is not None:
            mask = self._tree_mask(first, window)
            if explicit:
                mask = ~mask
        elif n > 1:
            if not explicit and first == 0 and start == 0 and (window is None or window >= n):
                causal = True
            else:
                device = self.cache.device
                q_pos = torch.arange(start, kv_len, device=device)[:, None]
                k_pos = torch.arange(first, kv_len, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                if explicit:
                    mask = ~mask
        out = (first, mask, causal)
        self._layouts[key] = out
        return out

    def _tree_mask(self, first: int, window: int | None) -> torch.Tensor:  # [num_new, kv_len - first] bool
        if self.tree is None:
            raise KVCacheUsageError("PagedContext._tree_mask: this forward has no tree")
        depths, visible = self.tree
        start, device = self.plan.start, self.cache.device
        committed = torch.ones(len(depths), start - first, dtype=torch.bool, device=device)
        mask = torch.cat([committed, visible], dim=1)
        if window is not None:
            q_pos = (start + depths)[:, None]
            k_pos = torch.cat([torch.arange(first, start, device=device), start + depths])[None, :]
            mask = mask & (k_pos > q_pos - window)
        return mask


class PassCancelled(Exception):
    """A forward given a cancel event (:class:`PagedContext`) stopped between two layers because it was set. The
    pass's reserved slots hold partial K/V: the caller gives them back (``seq.truncate``) and keeps nothing of it."""


def check_cancel(ctx: object) -> None:
    """Raise :class:`PassCancelled` if ``ctx`` (a :class:`PagedContext`, or a graph runner's static context,
    which has none) carries a cancel event that is set: called before each layer, so a long prefill pass stops
    within one layer's time, and every pass that completes computes exactly what it did without the check."""
    cancel = getattr(ctx, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise PassCancelled("the pass was cancelled")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, causal: bool, scale: float) -> torch.Tensor:
    # q [1, Hq, n, D]; k, v [1, Hkv, kv, D] -> [1, Hq, n, D]. enable_gqa beats expanding KV heads on CPU
    # (benchmarks/RESULTS.md, "Figures moved out of the code"); CUDA's fused kernels take GQA only without a mask
    # and with head_dim <= 256 (as transformers' use_gqa_in_sdpa), else expanding keeps them off the math kernel.
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda and (mask is not None or k.shape[-1] > 256):
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def softcapped(q, k, v, blocked, scale: float, softcap: float) -> torch.Tensor:
    # Mirrors transformers' eager_attention_forward (SDPA cannot softcap): scale, tanh cap, mask, fp32 softmax.
    # q [1, Hq, n, D] is viewed as [1, Hkv, rep*n, D] (query head h uses KV head h // rep), so KV heads are
    # never expanded.
    _, hq, n, d = q.shape
    hkv, kv = k.shape[1], k.shape[2]
    rep = hq // hkv
    scores = torch.matmul(q.reshape(1, hkv, rep * n, d), k.transpose(-1, -2)) * scale  # [1, Hkv, rep*n, kv]
    scores = torch.tanh(scores / softcap) * softcap
    if blocked is not None:
        scores = scores.view(1, hkv, rep, n, kv).masked_fill(blocked, float("-inf")).view(1, hkv, rep * n, kv)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).view(1, hq, n, d)


def paged_attention_forward(
    module: AttentionModule,
    query: torch.Tensor,  # [1, Hq, n, D]
    key: torch.Tensor,  # [1, Hkv, n, D]
    value: torch.Tensor,  # [1, Hkv, n, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, n, Hq, D], no attention weights)
    """The function registered as ``ATTN_IMPLEMENTATION``: write new K/V into the cache, attend over it."""
    ctx = kwargs.get("paged")  # a PagedContext, or the static context of a graph runner
    if ctx is None:
        raise KVCacheUsageError(
            f"a model using attn_implementation={ATTN_IMPLEMENTATION!r} must be run through "
            "the model runner (specchat.backend.engine.runner: ModelRunner.forward or forward_paged); switch it to "
            "'sdpa' to call it directly"
        )
    if kwargs.get("s_aux") is not None:
        raise ModelLoadError("this model uses attention sinks (s_aux), which specchat's paged attention lacks")
    if query.shape[0] != 1:
        raise KVCacheUsageError(f"paged attention runs one sequence at a time, got batch {query.shape[0]}")
    layer, head_dim = module.layer_idx, module.head_dim
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    if not isinstance(ctx, PagedContext):  # static mode (cuda_graphs.StaticContext): fixed shapes, graph-safe
        return ctx.attend(layer, query, key, value, scale, kwargs.get("sliding_window"), kwargs.get("softcap")), None
    check_cancel(ctx)
    cache, plan = ctx.cache, ctx.plan
    cache.write(layer, plan, key, value)
    window = kwargs.get("sliding_window")
    if window is not None and window >= plan.kv_len:
        window = None  # every key is inside the window: same as full attention, and shares its layout
    softcap = kwargs.get("softcap")
    first, mask, causal = ctx.layout(window, softcap is not None)
    k, v = cache.read(layer, plan, first)
    if k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    if softcap is None:
        out = _sdpa(query, k, v, mask, causal, scale)
    else:
        out = softcapped(query, k, v, mask, scale, float(softcap))
    return out.transpose(1, 2), None


def register() -> str:
    """Register the paged attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface  # deferred: importing it loads most of transformers

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


def use_paged_attention(model) -> None:
    """Check ``model`` is supported, register, and switch its attention to ``ATTN_IMPLEMENTATION``.

    A multimodal model switches only its language model; its other towers (vision) keep SDPA.
    """
    check_supported(model.config)
    name = register()
    sub_configs = getattr(model.config, "sub_configs", None) or {}
    if sub_configs:
        model.set_attn_implementation({"": name, **{k: name if k == "text_config" else "sdpa" for k in sub_configs}})
    else:
        model.set_attn_implementation(name)
