"""Gumbel noise keyed by (seed, reply position, token id): the randomness of every sampled token.

Contract: :func:`gumbel_noise` returns g[i, j] = G(seed, positions[i], ids[i, j]), a standard Gumbel variate that
is a fixed function of its three integers and nothing else: no generator state, no call order, no batch shape.
The target's token at reply position i is argmax_v(log p'_i(v) + g_i(v)), an exact sample from p'_i (the
Gumbel-max trick), so the same seed replays the same reply whatever was drafted and however the positions were
grouped into passes (:func:`specchat.backend.speculative.sampling.pick` uses it; drafter-invariant speculative
decoding, Daliri et al., arXiv 2408.07978).

The hash is counter-based, built from splitmix64 (Steele, Lea and Flood 2014): ``finalise`` is its output
function and mix(x) = finalise(x + γ), γ = 0x9E3779B97F4A7C15. The row key k = mix(mix(mix(seed) + D) + position)
selects a stream, and token v's 64 bits are finalise(k + (v + 1) · γ), the stream's (v + 1)-th output. Seeds
s and s + 1 (``specchat generate --samples`` uses consecutive seeds) get unrelated streams: nothing here seeds
a generator with seed + position. The top 53 bits give u = (m + 0.5) / 2**53 in (0, 1), and g = -log(-log u),
in float64 (g <= 37.4). MPS has no float64: there the top 24 bits and float32 are used, so a seed replays per
device type.

Position: the index of the token in the reply (0 for the token the prefill pass decides), as the engine
(``backend/engine/request.py``) and the draft model number them. Vectorised in torch int64 (wrapping
multiplication; logical right shifts emulated with a mask), on the ids' device, in place (a full-vocabulary
row is ~50-150k values; allocations cost as much as the arithmetic on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_DOMAIN = 0x5EC5C4A7  # D: keeps the row keys apart from a plain splitmix64 stream seeded with the same seed


def _signed(x: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def finalise64(z: int) -> int:
    """splitmix64's output function on a Python int (exact, unsigned 64-bit): the reference the tensors match."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def mix64(x: int) -> int:
    """One splitmix64 step from state ``x``: finalise(x + γ)."""
    return finalise64(x + _GOLDEN)


def row_key(seed: int, position: int) -> int:
    """The 64-bit stream key of reply position ``position`` under ``seed`` (both >= 0)."""
    return mix64(mix64(mix64(seed & _MASK64) + _DOMAIN) + position)


def token_bits(seed: int, position: int, token: int) -> int:
    """The 64 bits behind G(seed, position, token), in plain Python."""
    return finalise64(row_key(seed, position) + (token + 1) * _GOLDEN)


def reference_gumbel(seed: int, position: int, token: int) -> float:
    """G(seed, position, token) in plain Python (float64): what :func:`gumbel_noise` computes, for tests."""
    u = ((token_bits(seed, position, token) >> 11) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


def _xor_shift(z: torch.Tensor, s: int, scratch: torch.Tensor) -> None:
    """z ^= z >>> s (logical shift of the int64 bits), in place."""
    torch.bitwise_right_shift(z, s, out=scratch)
    scratch &= (1 << (64 - s)) - 1
    z ^= scratch


def gumbel_noise(seed: int, positions: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
    """G(seed, positions[i], ids[i, j]) for ids [n, m] (int64, any device) -> [n, m] float64 (float32 on MPS).

    ``ids`` may be a [1, m] row shared by every position (it broadcasts to [n, m]); any int64 has its noise."""
    device = ids.device
    keys = torch.tensor([[_signed(row_key(seed, int(p)))] for p in positions], dtype=torch.long, device=device)
    z = (ids.to(torch.long) + 1) * _signed(_GOLDEN)
    z = z + keys  # [n, m]: a new tensor, wrapping like the reference
    scratch = torch.empty_like(z)
    _xor_shift(z, 30, scratch)
    z *= _signed(_MUL1)
    _xor_shift(z, 27, scratch)
    z *= _signed(_MUL2)
    _xor_shift(z, 31, scratch)
    if device.type == "mps":
        torch.bitwise_right_shift(z, 40, out=scratch)
        scratch &= (1 << 24) - 1
        u = scratch.to(torch.float32).add_(0.5).mul_(2.0**-24)
    else:
        torch.bitwise_right_shift(z, 11, out=scratch)
        scratch &= (1 << 53) - 1
        u = scratch.to(torch.float64).add_(0.5).mul_(2.0**-53)
    return u.log_().neg_().log_().neg_()
