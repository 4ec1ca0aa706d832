"""GGUF files of tiny random llama-architecture models, written with the ``gguf`` package's writer, and the
transformers model of exactly the file's weights.

``write_tiny_gguf(model, path, types)`` writes ``model``'s (a tiny transformers llama / mistral / qwen2) weights as
llama.cpp lays them out (names, q/k rows permuted for the llama architecture, norms F32) with each matrix in the
ggml type ``types`` names for it (``types[native name]``, else ``types["default"]``): types the ``gguf``
package quantises (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) from the model's values, K-quants (Q4_K, Q5_K,
Q6_K) as random codes with small scales written straight into the blocks. It then loads the de-quantised file
values back into ``model`` (rows in transformers' order), so ``model`` is the file's model: the reference the
native model must match to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

HALF_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # llama.cpp writes mistral as llama
NAMES = {  # transformers name (per layer) -> GGUF name
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
NATIVE = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
          "ffn_down": "down", "token_embd": "embed", "output": "head"}  # fmt: skip


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (its rotary layout)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_k_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random codes and sub-block scales, with super-block scales small enough that weights stay ~0.1."""
    kind = gguf.GGMLQuantizationType[name]
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    if name == "Q6_K":  # int8 sub-block scales: keep them to -16..16
        blocks[..., 192:208] = rng.integers(-16, 17, (rows, cols // per_block, 16)).astype(np.int8).view(np.uint8)
    for at in HALF_FIELDS[name]:
        scales = (rng.random((rows, cols // per_block)) * 0.0004 + 0.0001).astype(np.float16)
        blocks[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // per_block, 2)
    return blocks.reshape(rows, -1)


def _encode(values: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(the stored data, its de-quantised float32 values)."""
    kind = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32), values.astype(np.float32)
    if type_name in HALF_FIELDS:
        data = random_k_blocks(type_name, values.shape[0], values.shape[1], rng)
    else:
        data = gguf.quants.quantize(values.astype(np.float32), kind)
    return data, gguf.quants.dequantize(data, kind).reshape(values.shape).astype(np.float32)


def write_tiny_gguf(
    model: torch.nn.Module, path: Path, types: dict[str, str], *, seed: int = 0
) -> dict[str, tuple[np.ndarray, str, int | None]]:
    """Write the file (see the module docstring); returns each matrix's stored blocks by transformers name:
    (data, ggml type name, heads whose rows llama.cpp permuted or None), for :func:`through_kernels`."""
    config = model.config
    arch = ARCH[config.model_type]
    permuted = arch == "llama"
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_context_length(config.max_position_embeddings)
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    loaded: dict[str, torch.Tensor] = {}
    stored: dict[str, tuple[np.ndarray, str, int | None]] = {}

    def matrix(hf_name: str, gguf_name: str, native: str, heads: int | None = None) -> None:
        values = state[hf_name]
        if heads is not None:
            values = permute(values, heads)
        data, back = _encode(values, types.get(native, types["default"]), rng)
        kind = gguf.GGMLQuantizationType[types.get(native, types["default"])]
        writer.add_tensor(gguf_name, data, raw_dtype=kind if kind != gguf.GGMLQuantizationType.F32 else None)
        loaded[hf_name] = torch.from_numpy(unpermute(back, heads) if heads is not None else back)
        stored[hf_name] = (data, types.get(native, types["default"]), heads)

    def vector(hf_name: str, gguf_name: str) -> None:
        writer.add_tensor(gguf_name, state[hf_name].astype(np.float32))

    for i in range(config.num_hidden_layers):
        for hf, short in NAMES.items():
            heads = None
            if permuted and short in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if short == "attn_q" else config.num_key_value_heads
            matrix(f"model.layers.{i}.{hf}.weight", f"blk.{i}.{short}.weight", NATIVE[short], heads)
            bias = f"model.layers.{i}.{hf}.bias"
            if bias in state:
                values = state[bias]
                if heads is not None:
                    values = permute(values, heads)
                writer.add_tensor(f"blk.{i}.{short}.bias", values.astype(np.float32))
        vector(f"model.layers.{i}.input_layernorm.weight", f"blk.{i}.attn_norm.weight")
        vector(f"model.layers.{i}.post_attention_layernorm.weight", f"blk.{i}.ffn_norm.weight")
    matrix("model.embed_tokens.weight", "token_embd.weight", "embed")
    if "lm_head.weight" in state and not config.tie_word_embeddings:
        matrix("lm_head.weight", "output.weight", "head")
    vector("model.norm.weight", "output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        for name, values in loaded.items():
            model.state_dict()[name].copy_(values)
    return stored


class _KernelLinear(torch.nn.Module):
    """A linear layer computed by the block kernels on the file's blocks (outputs put back in transformers' row
    order where llama.cpp permuted them), plus transformers' bias."""

    def __init__(self, weight: torch.ScriptObject, heads: int | None, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_blocks, self.heads, self.bias = weight, heads, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight_blocks.matmul(x.reshape(-1, x.shape[-1]).float().contiguous())
        if self.heads is not None:
            y = torch.from_numpy(unpermute(y.T.numpy(), self.heads).T.copy())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def through_kernels(model: torch.nn.Module, stored: dict[str, tuple[np.ndarray, str, int | None]]) -> None:
    """Route ``model``'s projections and head through the block kernels on the blocks ``write_tiny_gguf``
    stored: transformers' forward then differs from the native model's only in summation order (attention,
    norms), the 8-bit activations of the quantised types included."""
    from specchat.backend.kernels import blocks

    modules = dict(model.named_modules())
    tied = "lm_head.weight" not in stored
    for name, (data, type_name, heads) in {
        **stored,
        **({"lm_head.weight": stored["model.embed_tokens.weight"]} if tied else {}),
    }.items():
        if name == "model.embed_tokens.weight":
            continue
        owner, _, _ = name.rpartition(".")
        module = modules[owner]
        rows, cols = module.weight.shape
        kernel = blocks.qweight(data, type_name, rows, cols)
        parent, _, child = owner.rpartition(".")
        setattr(modules[parent] if parent else model, child, _KernelLinear(kernel, heads, module.bias))


def absurd_gguf(path, **sizes: int):
    """A GGUF whose metadata states ``sizes`` (block_count, head_count ...) over one small tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {"block_count": 2, "embedding_length": 8, "head_count": 2, "head_count_kv": 2, **sizes}
    writer.add_block_count(values["block_count"])
    writer.add_embedding_length(values["embedding_length"])
    writer.add_feed_forward_length(16)
    writer.add_head_count(values["head_count"])
    writer.add_head_count_kv(values["head_count_kv"])
    writer.add_context_length(64)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
