"""Tiny random models of the seven families, written as GGUF files the way llama.cpp writes them, and the
transformers model over the same de-quantised weights (the reference a fast path must match).

Contract:

- ``gguf_config(family, **overrides)``: the tiny transformers config of ``family`` (``FAMILIES``) sized so every
  weight's rows are whole 256-weight K-quant super-blocks (hidden 256, intermediate 256, 4 heads of 64 over 2 KV
  heads, ``VOCAB_SIZE`` ids); llama gets Llama 3.1's ``llama3`` rope scaling, gemma3 six layers (llama.cpp's
  default pattern: five sliding, one global) with a linear-scaled global rope.
- ``write_gguf(model, path, qtype, family)`` writes ``model`` (a transformers model of ``family``) as a GGUF file
  of ``qtype`` (``QTYPES``): the metadata ``convert_hf_to_gguf.py`` writes (architecture keys, rope, windows,
  soft-caps, the ``gguf_vocab`` tokenizer and chat template), llama's q/k rows permuted, gemma's norms stored as
  ``1 + w``, 1-D tensors F32; F16 / Q8_0 / Q4_0 quantised with ``gguf.quants``; Q4_K / Q6_K blocks written byte by
  byte (random codes, small finite fp16 scales: valid blocks whose values do not come from the model).
- ``reference_model(path)``: the transformers model of the file as :mod:`specchat.backend.models.gguf.gguf_arch` /
  :mod:`gguf_tensors` read it back, loaded with the file's de-quantised weights (``gguf.quants.dequantize``).
- ``gguf_pair(family, qtype, folder, seed=0)``: the source model and the file written from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf_vocab import FAMILY_CHAT, ID, MERGES, TOKEN_TYPES, TOKENS, VOCAB_SIZE, tokenizer_metadata
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from specchat.backend.models.gguf.gguf_arch import GGUF_ARCH_OF, llama3_factors
from specchat.backend.models.gguf.gguf_file import read_gguf
from specchat.backend.models.gguf.gguf_tensors import CONFIG_ROLES, config_of, hf_state_dict, tensor_map

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
QTYPES = ("F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")
INIT_STD = 0.05
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=16384,
    rms_norm_eps=1e-5,
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
)
_FAMILY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("mistral", {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "gemma2": (
        "gemma2",
        {
            "sliding_window": 8,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 64,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 6,
            "sliding_window": 8,
            "query_pre_attn_scalar": 64,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "phi3": ("phi3", {"sliding_window": None, "original_max_position_embeddings": 16384}),
}


_FILE_TYPES = {
    "F16": "MOSTLY_F16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_K": "MOSTLY_Q4_K_M",
    "Q6_K": "MOSTLY_Q6_K",
}


def _token_ids(family: str) -> dict[str, Any]:
    """bos / eos / pad ids as the family's checkpoint states them (eos a list when a turn ends otherwise)."""
    chat = FAMILY_CHAT[family]
    eos = [ID[chat["eos"]]] + ([ID[chat["eot"]]] if chat["eot"] else [])
    return {
        "bos_token_id": ID[chat["bos"]],
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": ID["<pad>"],
    }


def gguf_config(family: str, **overrides: Any) -> PretrainedConfig:
    model_type, extra = _FAMILY[family]
    return AutoConfig.for_model(model_type, **{**_COMMON, **_token_ids(family), **extra, **overrides})


def build_source(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A float32 random model of ``family``; norms drawn around their identity so they matter."""
    config = gguf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 1:
                weight.add_(torch.randn_like(weight) * 0.1)
    return model


def _metadata(writer: gguf.GGUFWriter, config: PretrainedConfig, family: str, qtype: str) -> None:
    arch = GGUF_ARCH_OF[config.model_type]
    rope = config.rope_parameters or {}
    full = rope.get("full_attention", rope)
    writer.add_name(f"tiny-{family}")
    writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[qtype]]))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(full.get("rope_theta", 10000.0))
    if arch != "phi3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_sliding_window(config.sliding_window or 0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(list(MERGES))
    for key, value in tokenizer_metadata(family).items():
        if key in ("tokenizer.ggml.model",):
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)


def _k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random valid Q4_K / Q6_K blocks ``[rows, bytes per row]`` with small fp16 scales."""
    kind = gguf.GGMLQuantizationType[qtype]
    per, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    if qtype == "Q4_K":  # d, dmin (fp16), 12 bytes of 6-bit scales / mins, 128 bytes of 4-bit codes
        scales = np.array([3.5e-4, 2.6e-3], dtype=np.float16).view(np.uint8)
        blocks[..., 0:4] = scales
    else:  # Q6_K: 128 low-bit bytes, 64 high-bit bytes, 16 int8 scales, fp16 d
        blocks[..., 192:208] = rng.integers(-16, 17, size=(rows, cols // per, 16), dtype=np.int8).view(np.uint8)
        blocks[..., 208:210] = np.array([3e-4], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _gguf_tensors(model: PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under their GGUF names, as llama.cpp stores them (float32, before quantisation)."""
    config = model.config
    table = tensor_map(arch, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    by_hf = {role.hf: role for role in table.values() if role.role not in CONFIG_ROLES}
    out: dict[str, np.ndarray] = {}
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        role = by_hf[name]
        value = weight.detach().float()
        if role.unpermute_heads:  # llama.cpp's permutation (LlamaModel.permute): the inverse of unpermute_rows
            heads = role.unpermute_heads
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, *value.shape[1:]).swapaxes(1, 2)
            value = value.reshape(weight.shape)
        if role.minus_one:
            value = value + 1.0
        out[role.gguf] = value.numpy()
    if arch == "llama" and (config.rope_parameters or {}).get("rope_type") == "llama3":
        out["rope_freqs.weight"] = np.array(llama3_factors(config.rope_parameters, config.head_dim), np.float32)
    return out


def write_gguf(model: PreTrainedModel, path: str | Path, qtype: str, family: str, *, seed: int = 0) -> Path:
    """Write ``model`` as a GGUF file of ``qtype`` (see the module docstring). Returns the path."""
    path = Path(path)
    arch = GGUF_ARCH_OF[model.config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, model.config, family, qtype)
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, value in _gguf_tensors(model, arch).items():
        if value.ndim == 1:
            writer.add_tensor(name, value.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(name, value.astype(np.float16))
        elif qtype in ("Q4_K", "Q6_K"):
            writer.add_tensor(name, _k_blocks(*value.shape, qtype, rng), raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_back_config(path: str | Path) -> tuple[dict[str, Any], Any]:
    """``(config dict, GgufFile)`` as the app reads the file."""
    file = read_gguf(path)
    return config_of(file), file


def reference_model(path: str | Path) -> PreTrainedModel:
    """The transformers model the file describes, over its de-quantised weights (float32, eval, eager)."""
    config_dict, file = read_back_config(path)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    state = hf_state_dict(file, config_dict)
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise AssertionError(f"{path}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def gguf_pair(family: str, qtype: str, folder: str | Path, seed: int = 0) -> tuple[PreTrainedModel, Path]:
    """(source model, its GGUF file of ``qtype`` in ``folder``)."""
    model = build_source(family, seed)
    path = write_gguf(model, Path(folder) / f"tiny-{family}-{qtype}.gguf", qtype, family, seed=seed)
    return model, path
