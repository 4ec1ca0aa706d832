"""A compact forward for llama / mistral / qwen2 decoders with int4 / int8 layers: transformers' math, fewer ops.

Why: with 4-bit weights a pass of the embedded default reads ~70 MB, a few milliseconds on a CPU, and
transformers' forward spends as long again in Python and operator dispatch (30 layers of module calls,
masks, reshapes, and one kernel call per projection). This forward walks the same modules' tensors with
less of that: the q/k/v projections run as one int4 kernel call, as do gate/up (the packed weights of the
separate layers are concatenated once and the layers keep views into the joined copy, so nothing is stored
twice); rotary embedding is applied to queries and keys together; the final norm and head run only on the rows whose
logits are kept. Attention reads and writes the paged cache (``backend/kv/attention.py``'s function for a long
prefill); a pass of at most :data:`ROWWISE_ROWS` tokens attends one query at a time (:func:`_attend_rows`), so
each token's result does not depend on how many tokens its pass verifies — a tree of drafts included: a node
attends its window of the prefix and its own ancestors, in their order along its path.

Once built for the machine, ``backend/kernels/native.py`` runs the decoder layers of passes of at most
:data:`ROWWISE_ROWS` tokens in C++, with an attention of its own: the same guarantee (a pass's rows equal
one-token passes), logits equal to this loop's to rounding.

Contract: :func:`build(model)` returns a :class:`CompactForward` or raises :class:`Unsupported` with the
reason (another architecture, an activation other than SiLU, a layer type it does not know); the model
runner (``backend/engine/runner.py``) then keeps transformers' forward. ``compact(ids, positions, ctx,
logits_to_keep)`` returns the ``[logits_to_keep, vocab]`` float logits of the last positions, as the model's
own forward does for the same input through paged attention. Its operations are transformers' in the same
dtypes (residual stream and norms float32, projections through the same quantised layers, which round their
input to bfloat16); only the fused RMSNorm kernel (``F.rms_norm``), the joined projections and the row-wise
attention may differ in float32 rounding. ``tests/backend/kernels/test_compact.py`` checks it against
transformers' forward on tiny models of each family, and that a pass's rows equal one-token passes;
``tests/backend/engine/test_real_model.py`` that greedy output on the embedded default is the same for
every drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from specchat.backend.kernels import decoder_layout, int4_layout
from specchat.backend.kernels.quant_linear import Int4Linear, kernel_call
from specchat.backend.kv import attention

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROWWISE_ROWS = 64  # passes of at most this many tokens (every decoding and verification pass) attend row by row


class Unsupported(Exception):
    """The model cannot run the compact forward (the message says why)."""


class NativeLayers(Protocol):
    """The C++ decoder layers (``native.Native``) as the forward holds them."""

    def takes(self, n: int, ctx: attention.PagedContext) -> bool: ...

    def layers(
        self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, ctx: attention.PagedContext
    ) -> None: ...

    def release(self) -> None: ...  # once they are no longer used (by whoever attached them)


def _join(modules: list[nn.Module]) -> Int4Linear | None:
    """One Int4Linear computing ``modules`` side by side (their outputs concatenated), the layers re-pointed at
    views of the joined weights; None when they cannot be joined (not all int4 alike, a layout unknown here)."""
    layers = [m for m in modules if isinstance(m, Int4Linear)]
    if len(layers) != len(modules):
        return None
    first = layers[0]
    block = int4_layout.cpu_block_n()
    same = all(
        m.group_size == first.group_size
        and m.in_features == first.in_features
        and m.compute_dtype == first.compute_dtype
        and (m.bias is None) == (first.bias is None)
        and m.packed.device.type == "cpu"
        for m in layers
    )
    if block is None or not same or any(m.out_features % block for m in layers):
        return None
    packed = torch.cat([m.packed for m in layers])
    scales = torch.cat([m.scales_zeros for m in layers], dim=1).contiguous()
    bias = torch.cat([m.bias for m in layers if m.bias is not None]) if first.bias is not None else None
    joined = Int4Linear(first.in_features, packed.shape[0], first.group_size, packed, scales, bias)
    start = 0
    for m in layers:  # the separate layers read their rows of the joined copy: no second copy of the weights
        m.packed = packed[start : start + m.out_features]
        start += m.out_features
    return joined


class _Layer:
    __slots__ = (
        "attn",
        "norm1",
        "norm2",
        "eps1",
        "eps2",
        "qkv",
        "q",
        "k",
        "v",
        "o",
        "gate_up",
        "gate",
        "up",
        "down",
        "window",
        "scaling",
        "q_width",
        "kv_width",
        "heads",
        "kv_heads",
        "head_dim",
        "inter",
        "run",
    )

    def __init__(self, layer: decoder_layout.DecoderLayer, config: decoder_layout.Config) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps1 = float(getattr(layer.input_layernorm, "variance_epsilon", config.rms_norm_eps))
        self.eps2 = float(getattr(layer.post_attention_layernorm, "variance_epsilon", config.rms_norm_eps))
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.qkv = _join([self.q, self.k, self.v])
        self.gate_up = _join([self.gate, self.up])
        self.head_dim = int(attn.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.q_width, self.kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.inter = int(cast(int, self.gate.out_features))  # a linear layer's (int4, int8 or float)
        window: int | None = getattr(attn, "sliding_window", None)
        if config.model_type == "mistral":
            window = getattr(config, "sliding_window", None)
        self.window = window
        self.scaling = float(attn.scaling)
        # Each projection's matmul, bound once (quant_linear.kernel_call), by name.
        self.run: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            name: kernel_call(module)
            for name, module in (
                ("qkv", self.qkv),
                ("q", self.q),
                ("k", self.k),
                ("v", self.v),
                ("o", self.o),
                ("gate_up", self.gate_up),
                ("gate", self.gate),
                ("up", self.up),
                ("down", self.down),
            )
            if module is not None
        }


def _attend_rows(
    layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: attention.PagedContext
) -> torch.Tensor:
    """Write the new K/V, then attend each query over exactly the keys it sees, one query at a time.

    Query ``i`` (position ``p = start + i``) is computed with the same operations on the same tensors as a
    one-token pass at ``p`` would use, whatever ``n`` is: a verification pass gives every token the result
    plain decoding gives it. (A batched masked attention reduces over the whole key length, masked keys
    included, so its rows differ from a one-token pass in the last bits, and bfloat16 projections after it
    turn such bits into different tokens.) Returns ``[n, heads * head_dim]``."""
    cache, plan = ctx.cache, ctx.plan
    index = layer.attn.layer_idx
    cache.write(index, plan, k, v)
    window = layer.window if layer.window is not None and layer.window < plan.kv_len else None
    first = 0 if window is None else max(0, plan.start - window + 1)
    keys, values = cache.read(index, plan, first)
    # Widened once for the whole pass (a contiguous float32 copy); each query then reads a view of it, and a
    # one-token pass reads the same values through the whole copy.
    keys, values = keys[0].to(q.dtype), values[0].to(q.dtype)  # [kv_heads, L, d]
    keys_t = keys.transpose(1, 2)  # [kv_heads, d, L], a view
    n, d = q.shape[2], layer.head_dim
    rep = layer.heads // layer.kv_heads
    tree = tree_keys(ctx.tree, plan.start, first, window, keys.device) if ctx.tree is not None else None
    queries = q[0].transpose(0, 1).reshape(n, layer.kv_heads, rep, d)  # query head h reads KV head h // rep
    unused = _unused(q)  # baddbmm's input, ignored at beta=0 (the scale is applied inside the product)
    rows = []
    for i in range(n):
        # Views by narrow(): the same tensors as slicing, without Python's indexing (~30 of them a token).
        if tree is not None:  # a tree node sees the prefix and its own ancestors, in the order its path has them
            key_t, value = keys[:, tree[i]].transpose(1, 2), values[:, tree[i]]  # gathered as [L, d], like a chain
        elif n == 1 and window is None:  # the only query sees every key read
            key_t, value = keys_t, values
        else:
            position = plan.start + i
            low = 0 if window is None else max(0, position - window + 1) - first
            seen = position + 1 - first - low
            key_t, value = keys_t.narrow(2, low, seen), values.narrow(1, low, seen)
        scores = torch.baddbmm(unused, queries[i], key_t, beta=0, alpha=layer.scaling)  # [kv_heads, rep, L]
        rows.append(torch.bmm(torch.softmax(scores, dim=-1), value).view(1, layer.q_width))
    return rows[0] if n == 1 else torch.cat(rows)


_UNUSED: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _unused(like: torch.Tensor) -> torch.Tensor:
    """A [1, 1, 1] tensor of ``like``'s dtype and device for baddbmm's ignored input (made once, never written)."""
    key = (like.dtype, like.device)
    found = _UNUSED.get(key)
    if found is None:
        found = _UNUSED[key] = torch.zeros(1, 1, 1, dtype=like.dtype, device=like.device)
    return found


def tree_keys(
    tree: tuple[torch.Tensor, torch.Tensor], start: int, first: int, window: int | None, device: torch.device
) -> list[torch.Tensor]:
    """For each new token of a tree pass (at position ``start + depth``), the indices of the keys it attends
    among those read from position ``first``: the committed ones in its window, then the new tokens it sees (its
    ancestors and itself, inside its window), by slot, which is their order along its path. Plain decoding of
    that path reads the same keys in the same order, so a node's row is the one plain decoding gives."""
    depths, visible = tree
    out = []
    for i in range(visible.shape[0]):
        depth = int(depths[i])
        low = 0 if window is None else max(0, start + depth - window + 1)
        seen = torch.nonzero(visible[i], as_tuple=False).flatten()
        if window is not None:
            seen = seen[depths[seen] > depth - window]
        out.append(
            torch.cat(
                [torch.arange(max(low, first) - first, start - first, device=device), (start - first) + seen.to(device)]
            )
        )
    return out


class CompactForward:
    """See the module docstring."""

    def __init__(self, model: decoder_layout.CausalLM) -> None:
        config: decoder_layout.Config = model.config
        self.config = config
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.final_norm = model.model.norm.weight
        self.final_eps = float(getattr(model.model.norm, "variance_epsilon", config.rms_norm_eps))
        self.head = model.lm_head
        self.run_head = kernel_call(self.head)
        self.layers = [_Layer(layer, config) for layer in model.model.layers]
        self.hidden = int(config.hidden_size)
        # The C++ layers (backend/kernels/native.py) once built, bound, checked and adopted between requests;
        # they take passes of at most ROWWISE_ROWS tokens (the row-by-row attention's).
        self.native: NativeLayers | None = None

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        n: int,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        ctx: attention.PagedContext,
    ) -> torch.Tensor:
        d = layer.head_dim
        if layer.qkv is not None:
            qkv = layer.run["qkv"](x)
            qk = qkv.narrow(1, 0, layer.q_width + layer.kv_width)
            v = qkv.narrow(1, layer.q_width + layer.kv_width, layer.kv_width)
        else:
            qk = torch.cat([layer.run["q"](x), layer.run["k"](x)], dim=-1)
            v = layer.run["v"](x)
        qk = qk.view(1, n, layer.heads + layer.kv_heads, d).transpose(1, 2)
        # float32, as transformers' rotary embedding computes it: its rotate_half(qk) * sin, as one roll times
        # sin with its first half negated (the same products, exactly).
        qk = qk * cos + qk.roll(d // 2, -1) * signed_sin
        q, k = qk.narrow(1, 0, layer.heads), qk.narrow(1, layer.heads, layer.kv_heads)
        v = v.view(1, n, layer.kv_heads, d).transpose(1, 2)  # the cache stores it as it came (bfloat16 values)
        if n > ROWWISE_ROWS or not isinstance(ctx, attention.PagedContext):
            if v.dtype != q.dtype:
                v = v.to(q.dtype)
            out, _ = attention.paged_attention_forward(
                layer.attn, q, k, v, None, scaling=layer.scaling, paged=ctx, sliding_window=layer.window
            )
            out = out.reshape(n, layer.q_width)
        else:
            out = _attend_rows(layer, q, k, v, ctx)
        return layer.run["o"](out)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if layer.gate_up is not None:
            gate_up = layer.run["gate_up"](x)
            gate, up = gate_up.narrow(1, 0, layer.inter), gate_up.narrow(1, layer.inter, layer.inter)
        else:
            gate, up = layer.run["gate"](x), layer.run["up"](x)
        # SiLU in float32, as transformers' layers run it; in place on the float32 copy (the same values).
        return layer.run["down"](F.silu(gate.float(), inplace=True).mul_(up))

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: attention.PagedContext, logits_to_keep: int
    ) -> torch.Tensor:
        return self.run(ids, positions, ctx, logits_to_keep, self.native)

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: attention.PagedContext,
        logits_to_keep: int,
        native: NativeLayers | None,
    ) -> torch.Tensor:
        """The pass, its decoder layers through ``native`` (a ``native.Native``) when given and it takes it."""
        n = ids.numel()
        with torch.inference_mode():
            h = self.embed(ids).float()  # [n, hidden], the residual stream
            cos, sin = self.rotary(h[None], positions[None])  # [1, n, head_dim]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            shape = (self.hidden,)
            if native is not None and isinstance(ctx, attention.PagedContext) and native.takes(n, ctx):
                native.layers(h, cos, signed_sin, ctx)
            else:
                self._layers(h, n, cos, signed_sin, ctx)
            last = F.rms_norm(h[n - logits_to_keep :], shape, self.final_norm, self.final_eps)
            return self.run_head(last).float()

    def _layers(
        self, h: torch.Tensor, n: int, cos: torch.Tensor, signed_sin: torch.Tensor, ctx: attention.PagedContext
    ) -> None:
        shape = (self.hidden,)
        for layer in self.layers:  # the residual stream is this pass's own tensor: added to in place
            h.add_(self._attention(layer, F.rms_norm(h, shape, layer.norm1, layer.eps1), n, cos, signed_sin, ctx))
            h.add_(self._mlp(layer, F.rms_norm(h, shape, layer.norm2, layer.eps2)))


def build(model: nn.Module) -> CompactForward:
    """The compact forward of ``model``, or :class:`Unsupported` naming why it cannot have one."""
    config: Any = model.config  # transformers' or the skeleton's; its fields are read with fallbacks here
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        raise Unsupported(f"model type {getattr(config, 'model_type', None)!r} (supported: {', '.join(ARCHITECTURES)})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise Unsupported(f"activation {config.hidden_act!r}")
    if getattr(config, "mlp_bias", False):
        raise Unsupported("MLP bias")
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")):
        raise Unsupported("not a decoder of the llama family's layout")
    for layer in decoder_layout.layout(model).model.layers:
        attn = layer.self_attn
        if any(getattr(attn, name, None) is not None for name in ("q_norm", "k_norm")):
            raise Unsupported("query/key norms")
        if type(layer.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            raise Unsupported(f"activation {type(layer.mlp.act_fn).__name__}")
    return CompactForward(decoder_layout.layout(model))  # its layout checked above
