"""Linear layers on CPU through oneDNN with pre-packed weights: verification passes at the cost of one token.

Why: a verification pass multiplies every weight matrix by γ+1 rows. On a CPU, PyTorch's default GEMM is
efficient for one row (a matrix-vector product, memory-bound) and for many, but not for the 2..32 rows a
speculative step has: a pass over a few tokens costs far more than one over 1, nearly all of it in ``aten::mm``.
oneDNN's inner-product primitive with the weight reordered once into its blocked layout streams each weight once
for all rows, which makes long drafts nearly free here, as they are on a GPU (``benchmarks/RESULTS.md``, "Figures
moved out of the code").

How: :func:`pack_linears` gives every plain ``nn.Linear`` with a float32 weight a non-persistent buffer
``_packed`` (the reordered weight, made by ``torch.ops.mkldnn._reorder_linear_weight``) and switches its class
to :class:`PackedLinear`, whose forward calls ``torch.ops.mkldnn._linear_pointwise``. Quantised layers
(bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` are subclasses, not plain ``nn.Linear``) and other dtypes
are left alone (bfloat16 needs AVX-512 or AVX-NE-CONVERT in oneDNN). The dense weight stays where it was
(a tied output head shares it with the input embedding, and transformers' baselines in ``specchat bench``
run on it): packing costs a second copy of the linear weights, so the engine packs only when that copy fits
in the memory still free after loading (it is optional, so :mod:`memory`'s fit estimate leaves it out).
:func:`unpack_linears` restores stock modules (the bench's transformers twin, which must run what
transformers runs).

Exactness: the packed product differs from PyTorch's only in float32 rounding (accumulation order), like
any other kernel choice; the first layer is checked against ``F.linear`` when packing, and packing is
abandoned if it disagrees. ``SPECCHAT_CPU_PACKED=0`` turns it off.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from specchat.backend.kernels import switched_off

log = logging.getLogger(__name__)

ENV_SWITCH = "SPECCHAT_CPU_PACKED"
_CHECK_ROWS = 5
_CHECK_TOLERANCE = 1e-3  # relative to the output's scale; a wrong kernel is off by O(1), rounding by ~1e-6


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward uses the oneDNN-packed copy of its weight (see the module docstring)."""

    _packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return out


def enabled() -> bool:
    """Whether packing is allowed here: oneDNN in this PyTorch build, and not switched off by the environment."""
    if switched_off(ENV_SWITCH):
        return False
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def _candidates(model: nn.Module) -> list[nn.Linear]:
    return [
        m
        for m in model.modules()
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
    ]


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of ``model``'s eligible layers take (0 where packing does not apply)."""
    if not enabled():
        return 0
    return sum(m.weight.numel() * m.weight.element_size() for m in _candidates(model))


def _pack_one(module: nn.Linear) -> None:
    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
    module.register_buffer("_packed", packed, persistent=False)
    module.__class__ = PackedLinear


def _agrees(module: nn.Linear) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_CHECK_ROWS, module.in_features, generator=generator)
    with torch.no_grad():
        expected = F.linear(x, module.weight, module.bias)
        got = module(x)
    scale = float(expected.abs().max()) or 1.0
    return got.shape == expected.shape and float((got - expected).abs().max()) <= _CHECK_TOLERANCE * scale


def pack_linears(model: nn.Module) -> int:
    """Pack every eligible layer of ``model`` in place; the number packed (0 when disabled or unavailable)."""
    if not enabled():
        return 0
    layers = _candidates(model)
    if not layers:
        return 0
    try:
        _pack_one(layers[0])
        if not _agrees(layers[0]):
            unpack_linears(model)
            log.warning("oneDNN packed linear disagrees with F.linear on this machine; using the default kernels")
            return 0
        for layer in layers[1:]:
            _pack_one(layer)
    except (RuntimeError, NotImplementedError) as error:  # an unsupported CPU or build: stay on the defaults
        unpack_linears(model)
        log.warning("oneDNN packed linear unavailable (%s); using the default kernels", error)
        return 0
    return len(layers)


def unpack_linears(model: nn.Module) -> int:
    """Turn :class:`PackedLinear` layers back into stock ``nn.Linear`` (dropping the packed copies)."""
    count = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            del module._buffers["_packed"]
            module.__class__ = nn.Linear  # type: ignore[assignment]  # the class swap back: to the base class
            count += 1
    return count
