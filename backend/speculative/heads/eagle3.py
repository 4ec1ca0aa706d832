"""The EAGLE-3 draft head (Li et al., arXiv 2503.01840) in the layout its authors' and SGLang's checkpoints use.

Layout (state-dict keys exactly theirs): ``fc`` (3·target_hidden → hidden: the fusion of the target's low,
middle and high features), ``midlayer`` (one decoder layer whose attention reads 2·hidden: ``input_layernorm``
on the token's embedding and ``hidden_norm`` on the fused feature, concatenated; ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``), ``norm``, ``lm_head`` over ``draft_vocab_size``
ids, and the buffers ``d2t`` (draft id i is target id i + d2t[i]) and ``t2d`` (which target ids the draft
vocabulary has). ``embed_tokens`` is optional: without it the target's own embedding is used.

Contract of one head step, row t of a sequence: input (the embedding of token t+1, a feature of position t),
position t; output the layer's hidden state (pre-norm; the next depth's feature) and, through ``norm`` and
``lm_head``, logits over the draft vocabulary for token t+2. For committed positions the feature is
``fc(taps_t)`` (the target's three taps); a drafted node at depth d feeds its parent's output back and sits at
position n-1+d (``n`` committed tokens). Attention: rows of committed positions see the committed positions up
to their own (a plain causal cache, :class:`HeadCache`); a drafted node sees them all plus its ancestors and
itself — exactly what the training-time test trains (``backend/speculative/heads/training.py``).

Computation in the dtype the weights were loaded in (float32 on CPU: bfloat16 matrix products are slow there;
the loader then runs the linears on Q8_0 copies through the block kernels, ``backend/kernels/block_linear.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specchat.backend.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """The fields of an EAGLE-3 config.json this head uses (the rest is ignored)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (t2d's length)
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    taps: tuple[int, ...] | None  # the target layers read (eagle_aux_hidden_state_layer_ids); None: default

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Eagle3Config:
        """Read a config.json; :class:`ModelLoadError` naming ``where`` and the field for anything missing."""

        def need(key: str) -> Any:
            value = data.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ModelLoadError(f"{where}: field {key!r} = {value!r}: an EAGLE-3 config.json needs a number here")
            return value

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and not (
            isinstance(aux, list) and len(aux) == 3 and all(isinstance(t, int) and t >= 0 for t in aux)
        ):
            raise ModelLoadError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids = {aux!r}: need 3 layer ids")
        vocab = int(need("vocab_size"))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(data.get("draft_vocab_size") or vocab),
            target_hidden_size=int(data.get("target_hidden_size") or hidden),
            rms_norm_eps=float(data.get("rms_norm_eps") or 1e-6),
            rope_theta=float(data.get("rope_theta") or 10000.0),
            rope_scaling=data.get("rope_scaling") or None,
            taps=tuple(aux) if aux is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """A config.json the EAGLE authors' and SGLang's loaders read (LlamaForCausalLMEagle3)."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": False,
        }
        if self.taps is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.taps)}
        return out


def default_taps(num_layers: int) -> tuple[int, ...]:
    """The low, middle and high features EAGLE-3's authors read: the inputs of layers 2, L/2 and L-3."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _Mlp(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _Mlp(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) -> [.., heads * head_dim]


class Eagle3Head(nn.Module):
    """The head's weights and its one decoder step (see the module docstring)."""

    def __init__(self, config: Eagle3Config, *, fc_bias: bool = False, own_embedding: bool = False) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=fc_bias)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.d2t: torch.Tensor
        self.t2d: torch.Tensor
        self.inv_freq: torch.Tensor
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embedding else None
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self.register_buffer("inv_freq", _scaled_frequencies(inv, c.rope_scaling).float(), persistent=False)

    # -- pieces ------------------------------------------------------------------------------------------------
    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., head_dim] cos, sin
        """In float32 whatever the weights' dtype (positions reach thousands)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids."""
        return draft_ids + self.d2t[draft_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., draft_vocab] float32
        return self.lm_head(self.norm(hidden)).float()

    def qkv(
        self, emb: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [.., heads, d], keys and values [.., kv_heads, d] of rows (embedding, feature) at ``positions``
        (rotary applied)."""
        layer, c = self.midlayer, self.config
        x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(feature)), dim=-1)
        attn = layer.self_attn
        q = attn.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim))
        k = attn.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = attn.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        cos, sin = self.rotary(positions)
        cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin), v

    def finish(self, feature: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output from its attention's output [.., heads * head_dim] (residual: the feature)."""
        layer = self.midlayer
        h = feature + layer.self_attn.o_proj(attended)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The committed positions' feature from the target's three taps [.., 3 * target_hidden]."""
        return self.fc(taps.to(self.fc.weight.dtype))

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.config.head_dim)


def _scaled_frequencies(inv: torch.Tensor, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Rotary frequencies with the config's ``rope_scaling``: none, linear, or Llama 3's (the published EAGLE-3
    heads for Llama 3.x use it); other kinds are refused."""
    if not scaling:
        return inv
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
        )
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * out / factor + smooth * out
        between = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(between, mid, out)
    raise ModelLoadError(f"rope_scaling {dict(scaling)!r} of the head is not supported (none, linear or llama3)")


class HeadCache:
    """The head's own K/V of committed positions: plain tensors [kv_heads, capacity, d], grown by doubling.
    ``length`` entries are valid; :meth:`truncate` rolls back (a changed conversation)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.empty(kv_heads, 256, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v [n, kv_heads, d]
        n = k.shape[0]
        if self.length + n > self.k.shape[1]:
            size = max(2 * self.k.shape[1], self.length + n)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], size, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        self.k[:, self.length : self.length + n] = k.transpose(0, 1)
        self.v[:, self.length : self.length + n] = v.transpose(0, 1)
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:  # [kv_heads, length, d] each
        return self.k[:, : self.length], self.v[:, : self.length]
