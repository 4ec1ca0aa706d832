"""GGUF architectures as data: what llama.cpp's ``convert_hf_to_gguf.py`` writes for each family, read back into
the transformers configuration it came from.

Contract:

- :data:`ARCHS` has one :class:`GgufArch` row per ``general.architecture`` a file may state: ``llama`` (Llama 1-3.x
  and Mistral, which llama.cpp writes as ``llama``), ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3`` (text) and
  ``phi3``. A row says which transformers ``model_type`` the file becomes, whether llama.cpp permuted the rows of
  ``attn_q`` / ``attn_k`` for its rotary layout (``permuted_qk``), whether norms are stored as ``1 + w``
  (``norm_plus_one``: gemma), the activation, and the default sliding-window pattern (llama.cpp's
  ``load_swa_pattern``). Adding a family is adding a row (and its tensor rows in ``gguf_tensors.py``).
- :func:`config_from_gguf(metadata, tensors)` returns the transformers config dict (``AutoConfig.for_model(**d)``
  builds it) from the file's metadata and tensor table (``{name: shape}``, torch order): sizes, norms' epsilon,
  rope (``rope_theta``; ``linear`` / ``yarn`` scaling from ``rope.scaling.*``; Llama 3.x ``llama3`` scaling
  recovered from the ``rope_freqs`` tensor's values, passed as ``rope_freqs``; phi3's ``longrope`` from its
  ``rope_factors_long`` / ``rope_factors_short`` tensors, passed as ``longrope``), sliding windows and layer types,
  soft-caps, ``query_pre_attn_scalar`` (llama.cpp's rule: ``hidden / heads`` for the 27B Gemmas, else
  ``head_dim``), gemma3's local rope base (``rope.freq_base_swa``, default 10,000), tied embeddings (no
  ``output`` tensor), and bos / eos / pad ids (eos a list when the end-of-turn id differs).
- :func:`unsupported(metadata)` is None for an architecture in :data:`ARCHS`, else a sentence naming it.
- :func:`end_of_turn_ids(metadata)` are the ids a reply stops at: eos, eot and eom, as the file states them.

Everything raises :class:`GgufArchError` (a ``ValueError``) naming the key and value when the file lacks what the
family needs. Only the standard library is used: reading a config costs nothing at start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class GgufArchError(ValueError):
    """The file's metadata cannot describe a model of its architecture (the message names the key)."""


@dataclass(frozen=True, slots=True)
class GgufArch:
    name: str  # general.architecture
    model_type: str  # the transformers model_type it reads back as
    permuted_qk: bool  # llama.cpp permuted attn_q / attn_k rows (LlamaModel.permute in convert_hf_to_gguf)
    norm_plus_one: bool  # RMSNorm weights stored as 1 + w (transformers keeps w and computes x * (1 + w))
    activation: str  # transformers' name of the MLP activation
    swa_pattern: int  # llama.cpp's default: layer il slides when il % pattern < pattern - 1 (0: no pattern)
    families: tuple[str, ...]  # transformers model types written under this name


ARCHS: dict[str, GgufArch] = {
    row.name: row
    for row in (
        GgufArch("llama", "llama", True, False, "silu", 0, ("llama", "mistral")),
        GgufArch("qwen2", "qwen2", False, False, "silu", 0, ("qwen2",)),
        GgufArch("qwen3", "qwen3", False, False, "silu", 0, ("qwen3",)),
        GgufArch("gemma2", "gemma2", False, True, "gelu_pytorch_tanh", 2, ("gemma2",)),
        GgufArch("gemma3", "gemma3_text", False, True, "gelu_pytorch_tanh", 6, ("gemma3_text", "gemma3")),
        GgufArch("phi3", "phi3", False, False, "silu", 0, ("phi3",)),
    )
}
# transformers model_type -> the GGUF architecture llama.cpp writes it as.
GGUF_ARCH_OF: dict[str, str] = {family: row.name for row in ARCHS.values() for family in row.families}
# The layer counts of the 27B Gemmas: llama.cpp scales their queries by hidden / heads instead of head_dim.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_DEFAULT_THETA = 10000.0


def _decimal(value: float) -> float:
    """A float32 the file stores, as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(f"{float(value):.7g}")


def unsupported(metadata: Mapping[str, Any]) -> str | None:
    """None when the file's architecture has a row in :data:`ARCHS`, else why it is not mapped."""
    arch = metadata.get("general.architecture")
    if arch in ARCHS:
        return None
    return f"GGUF architecture {arch!r} is not one of {', '.join(ARCHS)}"


class _Meta:
    """``{arch}.key`` look-ups that name the key when it is missing or of the wrong kind."""

    def __init__(self, metadata: Mapping[str, Any], arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if isinstance(value, list) and value and len(set(value)) == 1:  # per-layer arrays of one value
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise GgufArchError(f"metadata {self.arch}.{key} = {value!r}: expected a whole number")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise GgufArchError(f"metadata {self.arch}.{key} = {value!r}: expected a number")
        return _decimal(value)


def _llama3_rope(factors: Sequence[float], theta: float, head_dim: int) -> dict[str, Any]:
    """The ``llama3`` rope parameters whose per-frequency divisors are ``factors`` (the ``rope_freqs`` tensor
    convert_hf_to_gguf writes): ``factor`` is the largest divisor; the divisors between 1 and it lie on a line in
    1 / wavelength that fixes ``original_max_position_embeddings`` and ``high_freq_factor`` once
    ``low_freq_factor`` is 1 (as in every Llama 3.x); they are checked by computing the divisors again."""
    factors = [float(f) for f in factors]
    theta = _decimal(theta)
    if len(factors) != head_dim // 2:
        raise GgufArchError(f"tensor rope_freqs has {len(factors)} values; a head of {head_dim} needs {head_dim // 2}")
    factor = _decimal(max(factors))
    wavelengths = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    if factor <= 1.0:
        raise GgufArchError(f"tensor rope_freqs holds no scaling (largest value {factor}): not a llama3 rope")
    # smooth in [0, 1] for the medium frequencies: 1 / r = (1 - s) / factor + s
    medium = [
        (1 / w, (1 / r - 1 / factor) / (1 - 1 / factor))
        for w, r in zip(wavelengths, factors)
        if 1.0 + 1e-6 < r < factor - 1e-6
    ]
    if len(medium) >= 2:
        (x0, s0), (x1, s1) = medium[0], medium[-1]
        slope = (s1 - s0) / (x1 - x0)  # = original / (high - low)
        offset = s0 - slope * x0  # = -low / (high - low)
        high = 1.0 - 1.0 / offset if offset < 0 else 4.0
        original = round(slope * (high - 1.0))
        high = round(high, 4)
    else:  # too few medium frequencies to measure: Llama 3's own numbers, checked below
        high, original = 4.0, 8192
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
        "rope_theta": theta,
    }
    again = llama3_factors(rope, head_dim)
    if any(abs(a - b) > 1e-3 * max(1.0, abs(b)) for a, b in zip(again, factors)):
        raise GgufArchError("tensor rope_freqs is not a llama3 rope scaling (its values follow no llama3 curve)")
    return rope


def llama3_factors(rope: Mapping[str, Any], head_dim: int) -> list[float]:
    """The divisor of each rotary frequency under ``llama3`` scaling (what convert_hf_to_gguf stores)."""
    theta, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(head_dim // 2):
        wavelength = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _rope(meta: _Meta, head_dim: int, context: int, rope_freqs: Sequence[float] | None) -> dict[str, Any]:
    theta = meta.float("rope.freq_base", _DEFAULT_THETA)
    kind = meta.get("rope.scaling.type")
    if rope_freqs is not None and meta.arch == "llama":
        return _llama3_rope(rope_freqs, theta, head_dim)
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    factor = meta.float("rope.scaling.factor", 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    if kind == "yarn":
        rope: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": meta.int("rope.scaling.original_context_length", context),
            "rope_theta": theta,
        }
        for key, name in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.yarn_attn_factor", "attention_factor"),
        ):
            if meta.get(key) is not None:
                rope[name] = meta.float(key)
        return rope
    raise GgufArchError(f"metadata {meta.arch}.rope.scaling.type = {kind!r}: not linear, yarn or none")


def _layer_types(meta: _Meta, row: GgufArch, layers: int) -> list[str] | None:
    """Each layer's attention, as llama.cpp decides it: an explicit per-layer pattern array, else the family's
    default pattern (None where the family has no sliding layers)."""
    explicit = meta.get("attention.sliding_window_pattern")
    if isinstance(explicit, list) and len(explicit) == layers:
        return ["sliding_attention" if flag else "full_attention" for flag in explicit]
    pattern = meta.int("attention.sliding_window_pattern", row.swa_pattern) if row.swa_pattern else 0
    if not pattern:
        return None
    return ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)]


def _token_ids(metadata: Mapping[str, Any]) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    bos, pad = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.padding_token_id")
    if isinstance(bos, int):
        ids["bos_token_id"] = bos
    if isinstance(pad, int):
        ids["pad_token_id"] = pad
    stops = end_of_turn_ids(metadata)
    if stops:
        ids["eos_token_id"] = stops[0] if len(stops) == 1 else list(stops)
    return ids


def end_of_turn_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """eos, then eot and eom where the file names them (``<|eot_id|>``, ``<end_of_turn>``, ``<|im_end|>``)."""
    out: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and not isinstance(value, bool) and value not in out:
            out.append(value)
    return tuple(out)


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensors: Mapping[str, Sequence[int]],
    *,
    rope_freqs: Sequence[float] | None = None,
    longrope: tuple[Sequence[float], Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The transformers config dict of a GGUF file (see the module docstring). ``tensors``: name -> shape in
    torch order; ``rope_freqs``: the values of the ``rope_freqs`` tensor when the file has one; ``longrope``: phi3's
    ``(rope_factors_long, rope_factors_short)`` values (Phi-3 128k's ``longrope`` scaling)."""
    why = unsupported(metadata)
    if why is not None:
        raise GgufArchError(why)
    row = ARCHS[str(metadata["general.architecture"])]
    meta = _Meta(metadata, row.name)
    embed = tensors.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise GgufArchError("the file has no 2-D token_embd.weight tensor")
    hidden = meta.int("embedding_length", embed[1])
    if hidden != embed[1]:
        raise GgufArchError(f"metadata {row.name}.embedding_length = {hidden} but token_embd.weight has {embed[1]}")
    heads = meta.int("attention.head_count")
    layers = meta.int("block_count")
    head_dim = meta.int("attention.key_length", hidden // max(heads, 1))
    context = meta.int("context_length", 4096)
    config: dict[str, Any] = {
        "model_type": row.model_type,
        "vocab_size": int(embed[0]),
        "hidden_size": hidden,
        "intermediate_size": meta.int("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": _rope(meta, head_dim, context, rope_freqs),
        **_token_ids(metadata),
    }
    config["hidden_act" if not row.norm_plus_one else "hidden_activation"] = row.activation
    if row.name in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if row.name == "phi3":
        _phi3(meta, config, head_dim, hidden, heads, longrope)
    if row.norm_plus_one:
        _gemma(meta, row, config, layers, head_dim, hidden, heads)
    return config


def _phi3(
    meta: _Meta,
    config: dict[str, Any],
    head_dim: int,
    hidden: int,
    heads: int,
    longrope: tuple[Sequence[float], Sequence[float]] | None,
) -> None:
    if longrope is not None:  # convert_hf_to_gguf stores longrope's factors as two tensors
        config["rope_parameters"] = {
            "rope_type": "longrope",
            "long_factor": [_decimal(f) for f in longrope[0]],
            "short_factor": [_decimal(f) for f in longrope[1]],
            "rope_theta": config["rope_parameters"]["rope_theta"],
        }
    # The stated window is read (its kind checked) but not applied: llama.cpp runs every Phi layer on full
    # attention (its PR 13676: no field says which layers slide, and Phi-3.5-MoE's window is its context), so a
    # file agrees with llama.cpp's reading of it past the window (Phi-3-mini-4k states 2,047).
    meta.int("attention.sliding_window", 0)
    config["sliding_window"] = None
    config["original_max_position_embeddings"] = meta.int(
        "rope.scaling.original_context_length", config["max_position_embeddings"]
    )
    rot = meta.int("rope.dimension_count", head_dim)
    config["rope_parameters"]["partial_rotary_factor"] = rot / head_dim
    config["head_dim"] = hidden // heads


def _gemma(
    meta: _Meta, row: GgufArch, config: dict[str, Any], layers: int, head_dim: int, hidden: int, heads: int
) -> None:
    is_27b = layers == _GEMMA_27B_LAYERS.get(row.name)
    config["query_pre_attn_scalar"] = hidden // heads if is_27b else head_dim
    final_cap = meta.float("final_logit_softcapping", 0.0)
    config["final_logit_softcapping"] = final_cap or None
    if row.name == "gemma2":
        config["attn_logit_softcapping"] = meta.float("attn_logit_softcapping", 0.0) or None
        config["sliding_window"] = meta.int("attention.sliding_window", 4096)
        config["layer_types"] = _layer_types(meta, row, layers)
        return
    window = meta.int("attention.sliding_window", 0)
    global_rope = config["rope_parameters"]
    local_theta = meta.float("rope.freq_base_swa", _DEFAULT_THETA)
    config["rope_parameters"] = {
        "full_attention": global_rope,
        "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
    }
    if window:
        config["sliding_window"] = window
        config["layer_types"] = _layer_types(meta, row, layers)
    else:  # no sliding window in the file: every layer global
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * layers
