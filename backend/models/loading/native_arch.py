"""What the native model (``backend/kernels/native_model.py``) needs of a configuration, and the tables that name a
checkpoint's tensors for it: one row per weight, so a family or a file format is added by adding rows.

Contract:
- :func:`architecture(config)` returns the :class:`~specchat.backend.kernels.native_model.Architecture` of a
  transformers config (or a ``skeleton.LightConfig`` with the same fields) for the families in
  :data:`FAMILIES`, or raises :class:`NativeUnsupported` naming the feature it lacks (another family, an MLP or
  output bias, a rope type whose frequencies follow the sequence's length, an activation it does not run).
  Defaults of fields a config leaves out are transformers' own for that family.
- :data:`HF_NAMES`: the native name of each weight (``q``, ``attn_norm``, ...) -> its name in a transformers
  state dict, per layer (``{i}``) or global; family rows override the common ones (gemma's four norms, phi3's
  fused projections). GGUF files are read through the models' own tables (``gguf_tensors.tensor_map``, whose
  roles are these native names, and ``gguf_arch.ARCHS``: llama's permuted q/k rows, gemma's 1 + w norms).
"""

from __future__ import annotations

from typing import Any

import torch

from specchat.backend.kernels.native_model import Architecture, Rotary
from specchat.backend.kernels.native_types import FAMILIES
from specchat.backend.kernels.rope import RopeUnsupported, rope_frequencies

_GEMMA = ("gemma2", "gemma3_text")
_SILU = ("silu", "swish")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


class NativeUnsupported(Exception):
    """The configuration has something the native model does not run (the message says what)."""


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _windows(config: Any, family: str, layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    if family in ("mistral", "phi3"):
        return (window,) * layers
    if family == "llama" or window is None:
        return (None,) * layers
    types = getattr(config, "layer_types", None)
    if types is None:
        if family == "gemma2":  # transformers' default: even layers slide
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        else:
            return (None,) * layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _rotaries(config: Any, family: str, layers: int, head_dim: int) -> tuple[tuple[Rotary, ...], tuple[int, ...], int]:
    """(rotary tables, each layer's table, rot_dim)."""
    params = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }
    max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    if all(isinstance(value, dict) for value in params.values()):  # per layer type (gemma3)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
        names = sorted(set(types))
        missing = [name for name in names if name not in params]
        if missing:
            raise NativeUnsupported(f"rope parameters for layer types {missing}")
        made = [rope_frequencies(params[name], head_dim, max_positions) for name in names]
        dims = {dim for _, _, dim in made}
        if len(dims) != 1:
            raise NativeUnsupported("layer types that rotate different numbers of values")
        tables = tuple(Rotary(inv, scale) for inv, scale, _ in made)
        return tables, tuple(names.index(kind) for kind in types), dims.pop()
    inv_freq, scaling, dim = rope_frequencies(params, head_dim, max_positions)
    return (Rotary(inv_freq, scaling),), (0,) * layers, dim


def architecture(config: Any) -> Architecture:
    """See the module docstring."""
    config = _text(config)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise NativeUnsupported(f"model type {family!r} (the native model runs {', '.join(FAMILIES)})")
    if getattr(config, "mlp_bias", False):
        raise NativeUnsupported("MLP biases")
    act = getattr(config, "hidden_activation", None) if family in _GEMMA else None
    act = act or getattr(config, "hidden_act", "silu")
    if act in _SILU:
        act = "silu"
    elif act in _GELU_TANH:
        act = "gelu_tanh"
    else:
        raise NativeUnsupported(f"activation {act!r}")
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    layers = int(config.num_hidden_layers)
    try:
        rotaries, rope_of_layer, rot_dim = _rotaries(config, family, layers, head_dim)
    except RopeUnsupported as error:
        raise NativeUnsupported(str(error)) from None
    if family in _GEMMA:
        scale = float(getattr(config, "query_pre_attn_scalar", head_dim)) ** -0.5
        embed_scale = float(torch.tensor(hidden**0.5, dtype=torch.float32))
    else:
        scale, embed_scale = head_dim**-0.5, 1.0
    return Architecture(
        family=family,
        hidden=hidden,
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        rot_dim=rot_dim,
        inter=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        layers=layers,
        eps=float(config.rms_norm_eps),
        act=act,
        norm_add_one=family in _GEMMA,
        embed_scale=embed_scale,
        attn_scale=scale,
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        windows=_windows(config, family, layers),
        rope_of_layer=rope_of_layer,
        rotaries=rotaries,
    )


# native name -> transformers state-dict name ({i}: the layer); None: the family has no such tensor.
HF_NAMES: dict[str, dict[str, str | None]] = {
    "common": {
        "embed": "model.embed_tokens.weight",
        "head": "lm_head.weight",
        "final_norm": "model.norm.weight",
        "attn_norm": "model.layers.{i}.input_layernorm.weight",
        "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "q": "model.layers.{i}.self_attn.q_proj.weight",
        "k": "model.layers.{i}.self_attn.k_proj.weight",
        "v": "model.layers.{i}.self_attn.v_proj.weight",
        "o": "model.layers.{i}.self_attn.o_proj.weight",
        "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
        "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
        "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
        "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
        "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
        "gate": "model.layers.{i}.mlp.gate_proj.weight",
        "up": "model.layers.{i}.mlp.up_proj.weight",
        "down": "model.layers.{i}.mlp.down_proj.weight",
        "o_bias": "model.layers.{i}.self_attn.o_proj.bias",
    },
    "gemma": {
        "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "post_ffn_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
    "phi3": {
        "qkv": "model.layers.{i}.self_attn.qkv_proj.weight",
        "gate_up": "model.layers.{i}.mlp.gate_up_proj.weight",
        "q": None,
        "k": None,
        "v": None,
        "gate": None,
        "up": None,
    },
}
MATRICES = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")
LAYER_VECTORS = (
    "attn_norm",
    "ffn_norm",
    "post_attn_norm",
    "post_ffn_norm",
    "q_norm",
    "k_norm",
    "q_bias",
    "k_bias",
    "v_bias",
)


def names_for(table: dict[str, dict[str, str | None]], family: str) -> dict[str, str]:
    """The names of ``family``'s tensors in ``table`` (the common rows, then the family's own)."""
    group = "gemma" if family in _GEMMA else family
    merged = {**table["common"], **table.get(group, {})}
    return {native: name for native, name in merged.items() if name is not None}
