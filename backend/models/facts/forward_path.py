"""Which forward path the engine will run a model on, read offline for `specchat models` (no model loads, no
build starts): the rule of ``backend/engine/runner.py`` and ``backend/models/loading/native_loading.py``, in words.

Contract: :func:`describe(spec, device)` is one line: the path and, where the CPU native model does not run, why.
"""

from __future__ import annotations

import os

from specchat.backend.kernels.native_types import FAMILIES
from specchat.backend.models.catalog.config import TORCH_QUANTIZATIONS, ModelSpec
from specchat.backend.models.facts import memory
from specchat.backend.models.facts.memory import Device, as_stored, device_type

# The architectures the compact int4 loop covers (backend/kernels/compact.py's ARCHITECTURES; not imported: that
# module imports torch, which a listing does not need).
COMPACT_ARCHITECTURES = ("llama", "mistral", "qwen2")


def describe(spec: ModelSpec, device: Device) -> str:
    kind = device_type(device)
    if kind == "cuda":
        graphs = os.environ.get("SPECCHAT_CUDA_GRAPHS", "1") != "0"
        return "CUDA: transformers' forward" + (", replayed from CUDA graphs" if graphs else "")
    if kind != "cpu":
        return f"transformers' forward on {kind}"
    if as_stored(spec, device):
        return f"CPU native kernels, the file's blocks as stored; until a first start has built them, {_fallback(spec)}"
    why = memory.native_unavailable_here()
    return f"{_fallback(spec)}: " + (f"the CPU kernels cannot run, {why}" if why is not None else _not_covered(spec))


def _fallback(spec: ModelSpec) -> str:
    """The CPU path without the native model."""
    if spec.quantization in TORCH_QUANTIZATIONS and spec.architecture in COMPACT_ARCHITECTURES:
        return f"the int4/int8 torch loop (quantization: {spec.quantization})"
    if spec.quantization in TORCH_QUANTIZATIONS:
        return f"transformers' forward with {spec.quantization} layers"
    return "transformers' forward"


def _not_covered(spec: ModelSpec) -> str:
    if spec.quantization in ("nf4", "int8"):
        return f"quantization {spec.quantization} asks for bitsandbytes"
    if spec.trust_remote_code:
        return "the model's own code (trust_remote_code)"
    if spec.architecture not in FAMILIES:
        return f"the native model does not cover {spec.architecture!r}"
    return f"quantization {spec.quantization} re-quantises its float weights"
