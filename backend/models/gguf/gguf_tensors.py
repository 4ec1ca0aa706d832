"""GGUF tensor names as data: each tensor llama.cpp writes, its role, and the transformers weight it was made from.

Contract:

- :data:`TENSORS` rows are ``(gguf name, role, transformers name)``; ``{i}`` stands for the layer. Roles are the
  native model's vocabulary (``embed``, ``head``, ``final_norm``, ``attn_norm``, ``ffn_norm``, ``post_attn_norm``,
  ``post_ffn_norm``, ``q``, ``k``, ``v``, ``o``, ``qkv``, ``gate``, ``up``, ``gate_up``, ``down``, ``q_norm``,
  ``k_norm``, ``q_bias``, ``k_bias``, ``v_bias``, ``o_bias``; ``rope_freqs``, ``rope_long``, ``rope_short``:
  rotary factors that become configuration, not weights). :data:`FAMILY_ROWS` override the common rows per GGUF
  architecture (gemma's four norms a layer, phi3's fused ``attn_qkv`` and ``ffn_up`` holding gate then up).
- :func:`tensor_map(arch, layers)` resolves them for one file: ``{gguf name: TensorRole}``; :func:`roles_of(file)`
  maps the tensors a :class:`~specchat.backend.models.gguf.gguf_file.GgufFile` holds and raises :class:`GgufArchError`
  naming any tensor the table does not know, or a required one the file lacks.
- :func:`config_of(file)`: the file's transformers config dict (``gguf_arch.config_from_gguf``, its ``rope_freqs``
  and phi3's ``rope_factors_long`` / ``_short`` read), errors prefixed with the file's path.
- :func:`hf_state_dict(file, config)` de-quantises the file into the transformers state dict (float32): llama's
  q/k rows un-permuted (``GgufArch.permuted_qk``, whole rows, so a block format could be moved the same way
  unread), gemma's norms less one (``norm_plus_one``), the tied head left out. It is the reference a test
  compares a fast path against, and what ``transformers`` loads when it runs a GGUF model itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specchat.backend.models.gguf.gguf_arch import ARCHS, GgufArchError, config_from_gguf
from specchat.backend.models.gguf.gguf_file import GgufFile, dequantize, unpermute_rows

_L = "model.layers.{i}."
# (gguf name, role, transformers name or "" where it is configuration)
TENSORS: tuple[tuple[str, str, str], ...] = (
    ("token_embd.weight", "embed", "model.embed_tokens.weight"),
    ("output.weight", "head", "lm_head.weight"),
    ("output_norm.weight", "final_norm", "model.norm.weight"),
    ("rope_freqs.weight", "rope_freqs", ""),
    ("blk.{i}.attn_norm.weight", "attn_norm", _L + "input_layernorm.weight"),
    ("blk.{i}.ffn_norm.weight", "ffn_norm", _L + "post_attention_layernorm.weight"),
    ("blk.{i}.attn_q.weight", "q", _L + "self_attn.q_proj.weight"),
    ("blk.{i}.attn_k.weight", "k", _L + "self_attn.k_proj.weight"),
    ("blk.{i}.attn_v.weight", "v", _L + "self_attn.v_proj.weight"),
    ("blk.{i}.attn_output.weight", "o", _L + "self_attn.o_proj.weight"),
    ("blk.{i}.attn_q.bias", "q_bias", _L + "self_attn.q_proj.bias"),
    ("blk.{i}.attn_k.bias", "k_bias", _L + "self_attn.k_proj.bias"),
    ("blk.{i}.attn_v.bias", "v_bias", _L + "self_attn.v_proj.bias"),
    ("blk.{i}.attn_output.bias", "o_bias", _L + "self_attn.o_proj.bias"),
    ("blk.{i}.attn_q_norm.weight", "q_norm", _L + "self_attn.q_norm.weight"),
    ("blk.{i}.attn_k_norm.weight", "k_norm", _L + "self_attn.k_norm.weight"),
    ("blk.{i}.ffn_gate.weight", "gate", _L + "mlp.gate_proj.weight"),
    ("blk.{i}.ffn_up.weight", "up", _L + "mlp.up_proj.weight"),
    ("blk.{i}.ffn_down.weight", "down", _L + "mlp.down_proj.weight"),
)
_GEMMA = (
    ("blk.{i}.post_attention_norm.weight", "post_attn_norm", _L + "post_attention_layernorm.weight"),
    ("blk.{i}.ffn_norm.weight", "ffn_norm", _L + "pre_feedforward_layernorm.weight"),
    ("blk.{i}.post_ffw_norm.weight", "post_ffn_norm", _L + "post_feedforward_layernorm.weight"),
)
FAMILY_ROWS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "phi3": (
        ("blk.{i}.attn_qkv.weight", "qkv", _L + "self_attn.qkv_proj.weight"),
        ("blk.{i}.ffn_up.weight", "gate_up", _L + "mlp.gate_up_proj.weight"),  # gate rows, then up rows
        ("rope_factors_long.weight", "rope_long", ""),
        ("rope_factors_short.weight", "rope_short", ""),
    ),
}
# Roles every layer must have, per architecture (biases, q/k norms and the head are optional where absent).
_REQUIRED_LAYER = {
    "llama": ("attn_norm", "ffn_norm", "q", "k", "v", "o", "gate", "up", "down"),
    "qwen2": ("attn_norm", "ffn_norm", "q", "k", "v", "o", "gate", "up", "down", "q_bias", "k_bias", "v_bias"),
    "qwen3": ("attn_norm", "ffn_norm", "q", "k", "v", "o", "gate", "up", "down", "q_norm", "k_norm"),
    "gemma2": ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "q", "k", "v", "o", "gate", "up", "down"),
    "phi3": ("attn_norm", "ffn_norm", "qkv", "o", "gate_up", "down"),
}
_REQUIRED_LAYER["gemma3"] = (*_REQUIRED_LAYER["gemma2"], "q_norm", "k_norm")
CONFIG_ROLES = ("rope_freqs", "rope_long", "rope_short")  # rotary factors: configuration, not weights
NORM_ROLES = ("final_norm", "attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm")


@dataclass(frozen=True, slots=True)
class TensorRole:
    gguf: str  # the tensor's name in the file
    role: str  # see the module docstring
    layer: int | None  # None for the model-wide tensors
    hf: str  # the transformers state-dict name ("" for configuration roles)
    unpermute_heads: int  # > 0: rows are in llama.cpp's rotary order for this many heads (undo before use)
    minus_one: bool  # stored as 1 + w: subtract one for transformers' weight


def _rows(arch: str) -> list[tuple[str, str, str]]:
    rows = {gguf: (gguf, role, hf) for gguf, role, hf in TENSORS}
    for gguf, role, hf in FAMILY_ROWS.get(arch, ()):
        rows[gguf] = (gguf, role, hf)
    return list(rows.values())


def tensor_map(arch: str, layers: int, heads: int = 0, kv_heads: int = 0) -> dict[str, TensorRole]:
    """Every tensor name a file of ``arch`` with ``layers`` layers may hold -> its role (see the docstring).
    ``heads`` / ``kv_heads`` size llama's un-permutation (0: not needed)."""
    if arch not in ARCHS:
        raise GgufArchError(f"GGUF architecture {arch!r} is not one of {', '.join(ARCHS)}")
    row = ARCHS[arch]
    out: dict[str, TensorRole] = {}
    for gguf, role, hf in _rows(arch):
        for layer in range(layers) if "{i}" in gguf else [None]:
            name = gguf.format(i=layer)
            permute = 0
            if row.permuted_qk and role in ("q", "q_bias"):
                permute = heads
            elif row.permuted_qk and role in ("k", "k_bias"):
                permute = kv_heads
            out[name] = TensorRole(
                gguf=name,
                role=role,
                layer=layer,
                hf=hf.format(i=layer),
                unpermute_heads=permute,
                minus_one=row.norm_plus_one and role in NORM_ROLES,
            )
    return out


def roles_of(file: GgufFile, config: Mapping[str, Any]) -> dict[str, TensorRole]:
    """The role of each tensor ``file`` holds (``config``: its :func:`~gguf_arch.config_from_gguf` dict)."""
    arch = file.architecture
    layers = int(config["num_hidden_layers"])
    table = tensor_map(arch, layers, int(config["num_attention_heads"]), int(config["num_key_value_heads"]))
    unknown = sorted(name for name in file.tensors if name not in table)
    if unknown:
        raise GgufArchError(
            f"{file.path}: tensor {unknown[0]!r} (and {len(unknown) - 1} more) is not part of a {arch} model "
            "as llama.cpp writes it"
        )
    present = {(r.role, r.layer) for name, r in table.items() if name in file.tensors}
    for role in ("embed", "final_norm"):
        if (role, None) not in present:
            raise GgufArchError(f"{file.path}: no {_name_of(table, role, None)} tensor")
    for layer in range(layers):
        for role in _REQUIRED_LAYER[arch]:
            if (role, layer) not in present:
                raise GgufArchError(f"{file.path}: no {_name_of(table, role, layer)} tensor")
    return {name: table[name] for name in file.tensors}


def _name_of(table: Mapping[str, TensorRole], role: str, layer: int | None) -> str:
    return next(r.gguf for r in table.values() if r.role == role and r.layer == layer)


def to_hf(role: TensorRole, weight: torch.Tensor) -> torch.Tensor:
    """A de-quantised tensor as transformers holds it (un-permuted rows, norms less one)."""
    if role.unpermute_heads:
        weight = weight[unpermute_rows(weight.shape[0], role.unpermute_heads)]
    if role.minus_one:
        weight = weight - 1.0
    return weight


def config_of(file: GgufFile) -> dict[str, Any]:
    """:func:`~gguf_arch.config_from_gguf` of an opened file (its ``rope_freqs`` values read when present)."""
    freqs = file.tensors.get("rope_freqs.weight")
    values = dequantize(freqs).reshape(-1).tolist() if freqs is not None else None
    long, short = file.tensors.get("rope_factors_long.weight"), file.tensors.get("rope_factors_short.weight")
    longrope = None
    if long is not None and short is not None:
        longrope = (dequantize(long).reshape(-1).tolist(), dequantize(short).reshape(-1).tolist())
    shapes = {name: tensor.shape for name, tensor in file.tensors.items()}
    try:
        return config_from_gguf(file.metadata, shapes, rope_freqs=values, longrope=longrope)
    except GgufArchError as error:
        raise GgufArchError(f"{file.path}: {error}") from None


def hf_state_dict(file: GgufFile, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The transformers state dict of ``file``, float32 (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, role in roles_of(file, config).items():
        if role.role in CONFIG_ROLES:
            continue
        out[role.hf] = to_hf(role, dequantize(file.tensors[name]))
    return out
