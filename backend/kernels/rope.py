"""Rotary embedding frequencies and cos/sin tables, as transformers computes them, without importing transformers.

Contract: :func:`rope_frequencies(params, head_dim, max_position_embeddings)` returns ``(inv_freq, scaling,
rot_dim)`` for one ``rope_parameters`` dict (transformers 5's form: ``rope_type``, ``rope_theta``, and the
type's fields; ``partial_rotary_factor`` rotates only the first ``rot_dim`` values of a head), for the types
``default``, ``linear``, ``llama3`` and ``yarn``, with the same torch operations as transformers'
``ROPE_INIT_FUNCTIONS`` (and the models' default), so the values are the same bits
(``tests/backend/kernels/test_rope.py``). Types whose frequencies change with the sequence's length
(``dynamic``, ``longrope``) raise :class:`RopeUnsupported`: a row's rotation would then depend on the pass.
:func:`cos_sin_tables(inv_freq, scaling, positions)` gives the ``[positions, rot_dim / 2]`` float32 tables of
positions ``0 .. positions-1``, as transformers' rotary embedding computes them for each position.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class RopeUnsupported(ValueError):
    """A rope type the native model does not run (the message names it)."""


def _base_frequencies(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(params: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn(params: dict[str, Any], base: float, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_frequencies(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float, int]:
    """``(inv_freq [rot_dim / 2] float32, cos/sin scaling, rot_dim)`` (see the module docstring)."""
    kind = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0, dim
    if kind == "linear":
        return _base_frequencies(base, dim) / params["factor"], 1.0, dim
    if kind == "llama3":
        return _llama3(params, _base_frequencies(base, dim)), 1.0, dim
    if kind == "yarn":
        inv_freq, scaling = _yarn(params, base, dim, max_position_embeddings)
        return inv_freq, scaling, dim
    raise RopeUnsupported(
        f"rope_type {kind!r} (its frequencies change with the sequence's length; the native model runs default, "
        "linear, llama3 and yarn)"
    )


def cos_sin_tables(inv_freq: torch.Tensor, scaling: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, len(inv_freq)]`` float32 (see the module docstring)."""
    freqs = torch.arange(positions, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling
