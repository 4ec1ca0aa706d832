"""Small float linears (a draft head's) through the GGUF block kernels, as Q8_0: drafting at a fraction of the cost.

Why: a draft head drafts between two target passes, and on CPU both ran through different GEMMs. PyTorch's float32
``F.linear`` (MKL) is several times slower on a head's few-row linears than ``qgemm`` on a Q8_0 copy of the same
weight (``blocks.qweight``), and more so right after a target pass, whose weight stream evicts the head's weights
from the caches (a Q8_0 copy is a quarter of the bytes to bring back): ``benchmarks/RESULTS.md``, "Draft heads'
linears as Q8_0 blocks".

What: :func:`quantize_linears` switches every plain ``nn.Linear`` of a module whose float32 weight has a width
that is a multiple of 32 to :class:`BlockLinear`, whose forward multiplies by a Q8_0 copy of the weight (per 32
inputs one fp16 scale and 32 int8 codes, as gguf's ``quants.quantize`` writes them). The float weight stays as it
was (the module's state_dict is unchanged; the copy is made once, so a layer whose weight changes later must be
switched again). Drafts are checked by the target, so the head's rounding changes which tokens it proposes at
most, never the reply.

A layer whose input is the target's raw residual stream (EAGLE-3's ``fc`` over the three taps) is better kept in
float32 (``keep``): that stream has a few channels thousands of times larger than the rest, and an activation
block of 32 holding one of them rounds the others to a step of max/127. Kept in float32, ``fc`` makes the
default's head agree with its float32 self more often (``benchmarks/RESULTS.md``, "Draft heads' linears as Q8_0
blocks", "Q8_0 changes few drafts").
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from specchat.backend.kernels import blocks

BLOCK = 32  # inputs per Q8_0 block


class BlockLinear(nn.Linear):
    """An ``nn.Linear`` whose forward uses the Q8_0 copy ``_blocks`` of its weight (see the module docstring)."""

    _blocks: Any  # torch.classes.specchat.QWeight (its matmul: [M, K] float32 -> [M, N])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        if flat.shape[0] == 0:
            out = flat.new_zeros(0, self.out_features)
        else:
            out = self._blocks.matmul(flat)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantize_linears(module: nn.Module, *, keep: Collection[str] = ()) -> int:
    """Switch ``module``'s plain float32 ``nn.Linear`` layers on CPU (input width a multiple of 32) to
    :class:`BlockLinear`, except those named in ``keep`` (``named_modules`` names); returns how many. Raises
    :class:`blocks.KernelsUnavailable` when the kernels cannot run here (nothing is changed then)."""
    blocks.load()
    switched = 0
    for name, layer in module.named_modules():
        if type(layer) is not nn.Linear or name in keep:
            continue
        weight = layer.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or layer.in_features % BLOCK:
            continue
        codes = quantize(weight.detach().numpy(), GGMLQuantizationType.Q8_0)  # gguf's own Q8_0 writer
        made = blocks.qweight(codes, "Q8_0", layer.out_features, layer.in_features)
        object.__setattr__(layer, "_blocks", made)  # a TorchScript object: kept out of the module's tensors
        layer.__class__ = BlockLinear
        switched += 1
    return switched
