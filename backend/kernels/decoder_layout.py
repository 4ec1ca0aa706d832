"""The attribute layout of a llama-family causal LM, as types: what the compact forward reads and the GGUF loader fills.

transformers' ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` and
``backend/models/skeleton.LightCausalLM`` share this layout (``model.embed_tokens / rotary_emb / norm /
layers[i].self_attn.{q,k,v,o}_proj / mlp.{gate,up,down}_proj / input_layernorm / post_attention_layernorm``,
``lm_head``, ``config``). torch types every sub-module reached by attribute as ``Tensor | Module``
(``nn.Module.__getattr__``), so code walking a model by these names sees none of its structure; :func:`layout`
gives a model under the Protocols below once the caller knows it has this layout (``compact.build`` checks it;
``quantized.from_gguf`` builds it). Types only: nothing here changes or checks a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn


class Config(Protocol):
    """The configuration fields the compact forward reads (transformers' config or ``skeleton.LightConfig``)."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float


class Norm(Protocol):
    """An RMSNorm: its weight (``variance_epsilon`` is read with a fallback: not every family names it)."""

    weight: torch.Tensor


class Embedding(Protocol):
    """``nn.Embedding`` or ``quant_linear.Q8Embedding``: ids ``[n]`` to rows ``[n, hidden]``."""

    num_embeddings: int

    def __call__(self, ids: torch.Tensor, /) -> torch.Tensor: ...


class Attention(Protocol):
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    layer_idx: int
    head_dim: int
    scaling: float


class MLP(Protocol):
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module


class DecoderLayer(Protocol):
    self_attn: Attention
    mlp: MLP
    input_layernorm: Norm
    post_attention_layernorm: Norm

    def get_submodule(self, target: str) -> nn.Module: ...  # an nn.Module's


class Decoder(Protocol):
    embed_tokens: Embedding
    rotary_emb: nn.Module  # (x, position_ids) -> (cos, sin), each [1, n, head_dim]
    norm: Norm
    layers: Sequence[DecoderLayer]  # an nn.ModuleList


class CausalLM(Protocol):
    config: Any  # transformers' config of the family, or skeleton.LightConfig; the fields read: Config
    model: Decoder
    lm_head: nn.Module


def layout(model: nn.Module) -> CausalLM:
    """``model`` itself, typed by its layout; the caller knows it has it (see the module docstring)."""
    return cast(CausalLM, model)
