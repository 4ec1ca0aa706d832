"""F16 GGUF files with each architecture's real layer shapes, norms and metadata, and random weights scaled so the
next-token distributions are peaked like a real model's (for ``agreement_vs_llama.py``; issue 48 item 2). Used by
``make_gguf.py --shape NAME``; quantise the result with llama.cpp's ``llama-quantize`` (Q8_0, Q4_K_M).

Shapes (:data:`SHAPES`): ``llama3-1b`` (Llama-3.2-1B: llama3 rope scaling through a ``rope_freqs`` tensor,
theta 500,000, tied), ``mistral-7b`` (Mistral-7B-v0.3, written as ``llama`` as llama.cpp does; it has no sliding
window in v0.2+), ``qwen2-0.5b`` (q/k/v biases), ``qwen3-0.6b`` (q/k norms, head 128 over hidden 1,024),
``gemma2-2b`` (four norms a layer, soft-caps 50 / 30, every other layer sliding, embedding × √hidden),
``gemma3-270m`` (262,144 vocabulary, q/k norms, five local layers to one global, rope bases 10,000 / 1,000,000,
window 512) and ``phi3-mini`` (fused ``attn_qkv`` and gate-up ``ffn_up``, head 96, window 2,047 in the metadata as
Phi-3-mini-4k's GGUF states it). ``--layers`` cuts the depth (the layer shapes stay).

Weights (why not all N(0, 0.02): random weights give near-uniform next-token distributions, where every position
is a near tie and agreement means nothing):

- q and k rows scaled so the attention scores have a standard deviation of ~5 (peaked attention, so rotary
  positions and windows decide what a head reads); with q/k norms, the norms' weights do it;
- v, o, gate, up, down of standard deviation 1 / √(input width), so each block adds ~unit-size updates;
- the embedding small next to what the layers add (the residual stream is mostly context, not the token), and
  the output layer the embedding (tied) or the embedding plus noise, with the final norm's weight setting the
  logits' spread across the vocabulary to ~5 (top-1 probabilities of ~0.3-0.9);
- every norm weight random in [0.5, 1.5] (× the scale above), so a norm applied in the wrong place shows.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from specchat.backend.models.gguf.gguf_arch import llama3_factors

LOGIT_STD = float(os.environ.get("ARCHS_LOGIT_STD", 7.0))  # the logits' spread across the vocabulary
SCORE_STD = float(os.environ.get("ARCHS_SCORE_STD", 1.5))  # the attention scores' spread
UPDATE = float(os.environ.get("ARCHS_UPDATE", 0.5))  # each block's update (rms)
SELF_LOGIT = float(os.environ.get("ARCHS_SELF", 4.0))  # the token's own logit above the rest, in spreads


@dataclass(frozen=True)
class Shape:
    arch: str  # general.architecture
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    theta: float
    eps: float
    context: int
    tied: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False  # post-norms, 1 + w norms (stored as the sum), embedding × √hidden
    fused: bool = False  # phi3's attn_qkv and gate-up ffn_up
    window: int = 0
    llama3_rope: bool = False


SHAPES: dict[str, Shape] = {
    "llama3-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, 500000.0, 1e-5, 131072, llama3_rope=True),
    "mistral-7b": Shape("llama", 4096, 14336, 32, 32, 8, 128, 32768, 1000000.0, 1e-5, 32768, tied=False),
    "qwen2-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 64, 151936, 1000000.0, 1e-6, 32768, qkv_bias=True),
    "qwen3-0.6b": Shape("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, 1000000.0, 1e-6, 40960, qk_norm=True),
    "gemma2-2b": Shape("gemma2", 2304, 9216, 26, 8, 4, 256, 256000, 10000.0, 1e-6, 8192, gemma=True, window=4096),
    "gemma3-270m": Shape(
        "gemma3", 640, 2048, 18, 4, 1, 256, 262144, 1000000.0, 1e-6, 32768, qk_norm=True, gemma=True, window=512
    ),
    "phi3-mini": Shape(
        "phi3", 3072, 8192, 32, 32, 32, 96, 32064, 10000.0, 1e-5, 4096, tied=False, fused=True, window=2047
    ),  # fmt: skip
}
# Llama 3.2's rope scaling (its config.json's rope_scaling).
LLAMA3_ROPE = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_rope_freqs(theta: float, head_dim: int) -> np.ndarray:
    """The divisor of each rotary frequency, as convert_hf_to_gguf writes ``rope_freqs`` for Llama 3.x (specchat's
    own reading of that scaling: the file then states what the loader would compute)."""
    return np.array(llama3_factors({**LLAMA3_ROPE, "rope_theta": theta}, head_dim), dtype=np.float32)


def write_shape(
    name: str,
    out: Path,
    tokenizer_gguf: Path,
    *,
    layers: int | None = None,
    vocab: int | None = None,
    window: int | None = None,
    seed: int = 0,
) -> None:
    """Write ``SHAPES[name]`` in F16 to ``out`` (``layers``, ``vocab``, ``window``: override the shape's)."""
    from make_gguf import copy_tokenizer  # the script's folder is on sys.path when make_gguf runs

    s = SHAPES[name]
    n_layers = layers or s.layers
    tokens = len(gguf.GGUFReader(str(tokenizer_gguf)).fields["tokenizer.ggml.tokens"].data)
    # A vocabulary smaller than the tokenizer's (Mistral's 32,768, Phi-3's 32,064 under SmolLM2's 49,152) would
    # need the BPE tables cut: such shapes take the tokenizer's size instead.
    n_vocab = vocab or max(s.vocab, tokens)
    if n_vocab < tokens:
        raise SystemExit(f"--vocab {n_vocab} is smaller than {tokenizer_gguf}'s {tokens} tokens")
    n_window = s.window if window is None else window
    rng = np.random.default_rng(seed)
    h, d = s.hidden, s.head_dim
    writer = gguf.GGUFWriter(str(out), s.arch)
    # Not the shape's name: llama.cpp gives special tokens of a model named "phi3" attributes by their text,
    # and fails on a tokenizer without Phi-3's "</s>".
    writer.add_name(f"specchat bench ({n_layers} of {s.layers} layers)")
    writer.add_block_count(n_layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(s.inter)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(s.theta)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_rope_dimension_count(d)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if s.arch == "llama":
        writer.add_vocab_size(n_vocab)
    if s.arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if n_window:
        writer.add_sliding_window(n_window)
    if s.arch == "gemma3":
        writer.add_rope_freq_base_swa(10000.0)
    copy_tokenizer(writer, tokenizer_gguf, n_vocab)

    def f16(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    def norm(size: int, scale: float = 1.0) -> np.ndarray:
        return (rng.uniform(0.5, 1.5, size) * scale).astype(np.float32)

    # Attention scores q·k / √d have a spread of √d σ² h with q, k rows of σ (inputs of unit size); with q/k
    # norms, of w² for norm weights w.
    qk_std = math.sqrt(SCORE_STD / (math.sqrt(d) * h))
    qk_norm_scale = math.sqrt(SCORE_STD)
    # Each block adds an update of ~UPDATE (rms; gemma's post-norms set it by their weights), so the residual
    # stream after n layers is ~√(ε² + 2n UPDATE²) for a start of ε; ε is chosen so the token's own logit (the
    # tied head reads the embedding) stands SELF_LOGIT spreads above the others': ε √h / stream = SELF_LOGIT.
    start = UPDATE * math.sqrt(2 * n_layers) / math.sqrt(h / SELF_LOGIT**2 - 1)
    embed_std = start / math.sqrt(h) if s.gemma else start
    head_scale = LOGIT_STD / (embed_std * math.sqrt(h))  # the final norm's weight: logits of spread LOGIT_STD
    out_std = UPDATE / (0.7 if not s.gemma else 1.0)  # ~0.7: what attention and the MLP give of unit inputs
    embed = f16(n_vocab, h, embed_std)
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output_norm.weight", norm(h, head_scale))
    if not s.tied:
        writer.add_tensor("output.weight", (embed + f16(n_vocab, h, embed_std * 0.5)).astype(np.float16))
    if s.llama3_rope:
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(s.theta, d))
    q_rows, kv_rows = s.heads * d, s.kv_heads * d
    for i in range(n_layers):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", norm(h))
        q_std = 1 / math.sqrt(h) if s.qk_norm else qk_std
        q, k, v = f16(q_rows, h, q_std), f16(kv_rows, h, q_std), f16(kv_rows, h, 1 / math.sqrt(h))
        if s.fused:
            writer.add_tensor(f"{blk}.attn_qkv.weight", np.concatenate([q, k, v]))
        else:
            writer.add_tensor(f"{blk}.attn_q.weight", q)
            writer.add_tensor(f"{blk}.attn_k.weight", k)
            writer.add_tensor(f"{blk}.attn_v.weight", v)
        if s.qkv_bias:
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                bias = rng.standard_normal(rows, dtype=np.float32) * 0.5
                writer.add_tensor(f"{blk}.{part}.bias", bias)
        if s.qk_norm:
            writer.add_tensor(f"{blk}.attn_q_norm.weight", norm(d, qk_norm_scale))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", norm(d, qk_norm_scale))
        writer.add_tensor(f"{blk}.attn_output.weight", f16(h, q_rows, out_std / math.sqrt(q_rows)))
        writer.add_tensor(f"{blk}.ffn_norm.weight", norm(h))
        if s.gemma:
            writer.add_tensor(f"{blk}.post_attention_norm.weight", norm(h, UPDATE))
            writer.add_tensor(f"{blk}.post_ffw_norm.weight", norm(h, UPDATE))
        gate, up = f16(s.inter, h, 1 / math.sqrt(h)), f16(s.inter, h, 1 / math.sqrt(h))
        if s.fused:
            writer.add_tensor(f"{blk}.ffn_up.weight", np.concatenate([gate, up]))
        else:
            writer.add_tensor(f"{blk}.ffn_gate.weight", gate)
            writer.add_tensor(f"{blk}.ffn_up.weight", up)
        writer.add_tensor(f"{blk}.ffn_down.weight", f16(h, s.inter, out_std / math.sqrt(s.inter)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
