"""Write GGUF files with random weights and the embedded model's tokenizer, for measuring specchat against
llama.cpp on the same file (a script, not a test; the files are large: put them under /tmp, never in the
repository).

``--arch llama`` (the default) writes ~1.07B-parameter llama files in the types below. ``--arch qwen2`` writes
Qwen2.5-0.5B's layer shapes (hidden 896, intermediate 4864, 24 layers, 14 heads over 2 KV heads, q/k/v biases,
rope theta 1,000,000, tied embeddings; ~0.4B parameters with this 49,152-token vocabulary) in F16 only, normal
weights of standard deviation 0.02: quantise it with llama.cpp's own ``llama-quantize`` to get the mix a real
file has (896 columns are not a multiple of 256, so a Q4_K_M falls back to Q5_0 / Q8_0 as Qwen2.5-0.5B's does).

llama files:

Shape (TinyLlama-1.1B's, with SmolLM2's 49,152-token vocabulary and tied embeddings): hidden 2048, intermediate
5632, 22 layers, 32 heads over 4 KV heads, rope theta 10,000. Weights are random 4-bit (or 6-bit) codes with a
small fixed scale (and, for Q4_K, a matching minimum so each block is centred), so activations stay finite
through every layer; norms are 1. Types:

- ``q4_0``: every matrix Q4_0 (the embedding too);
- ``q4_k_m``: the Q4_K_M mix: Q4_K, with Q6_K for the output (the tied embedding) and half of the ffn_down
  tensors (every other layer).

    python benchmarks/make_gguf.py --type q4_0 --out /tmp/bench-1b-q4_0.gguf
    python benchmarks/make_gguf.py --type q4_k_m --out /tmp/bench-1b-q4_k_m.gguf
    python benchmarks/make_gguf.py --arch qwen2 --type f16 --out /tmp/bench-qwen2-f16.gguf
    python benchmarks/make_gguf.py --arch qwen2 --type q8_0 --vocab 151936 --out /tmp/bench-qwen2-152k-q8_0.gguf
    llama-quantize /tmp/bench-qwen2-f16.gguf /tmp/bench-qwen2-q4_k_m.gguf Q4_K_M

``--shape NAME`` writes one architecture's real layer shapes, norms and metadata in F16 with weights scaled for
peaked next-token distributions (``gguf_archs.py``: llama3-1b, mistral-7b, qwen2-0.5b, qwen3-0.6b, gemma2-2b,
gemma3-270m, phi3-mini), ``--layers`` cutting the depth:

    python benchmarks/make_gguf.py --shape gemma3-270m --out /tmp/archs/gemma3-f16.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf_archs import SHAPES, write_shape  # this folder is on sys.path when the script runs

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 2048, 5632, 22, 32, 4, 49152
HEAD_DIM = HIDDEN // HEADS
# Block scales that give each weight a standard deviation of ~0.018 (activations of ~unit size after each norm).
Q4_0_SCALE = 0.004
Q4_K_SCALE = 1.2e-4  # × sub-block scale 32 × (q - 7.5)
Q6_K_SCALE = 6e-5  # × sub-block scale 16 × (q - 32)


def q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    blocks = np.empty((rows, cols // 32, 18), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(Q4_0_SCALE).tobytes(), dtype=np.uint8)
    blocks[..., 2:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    blocks = np.empty((rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(Q4_K_SCALE).tobytes(), dtype=np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(Q4_K_SCALE * 7.5).tobytes(), dtype=np.uint8)
    # Every sub-block's 6-bit scale and minimum 32 (ggml's packing: bytes 0-7 hold the low six bits and the top
    # two of the upper sub-blocks', bytes 8-11 the upper sub-blocks' low four bits).
    blocks[..., 4:12] = 0xA0
    blocks[..., 12:16] = 0x00
    blocks[..., 16:] = rng.integers(0, 256, (rows, cols // 256, 128), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def q6_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    blocks = np.empty((rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., :192] = rng.integers(0, 256, (rows, cols // 256, 192), dtype=np.uint8)
    blocks[..., 192:208] = 16  # int8 sub-block scales
    blocks[..., 208:210] = np.frombuffer(np.float16(Q6_K_SCALE).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


MAKERS = {"Q4_0": q4_0, "Q4_K": q4_k, "Q6_K": q6_k}


def plan(kind: str) -> dict[str, str]:
    """The type of each tensor (by GGUF name) in the mix ``kind``."""
    types: dict[str, str] = {}
    base = "Q4_0" if kind == "q4_0" else "Q4_K"
    types["token_embd.weight"] = base if kind == "q4_0" else "Q6_K"
    for i in range(LAYERS):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            types[f"blk.{i}.{name}.weight"] = base
        if kind == "q4_k_m" and i % 2 == 0:
            types[f"blk.{i}.ffn_down.weight"] = "Q6_K"
    return types


def shape_of(name: str) -> tuple[int, int]:
    """(rows, columns) of a matrix, torch order."""
    if name == "token_embd.weight":
        return VOCAB, HIDDEN
    short = name.split(".")[2]
    return {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }[short]


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab: int | None = None) -> None:
    """Every ``tokenizer.*`` value of ``source`` (the embedded model's GGUF) into ``writer``; with ``vocab``, the
    token list padded to that many with ordinary tokens (``x<i>``: entries of the BPE vocabulary that no merge
    makes, so the tokenizer's tables are a large vocabulary's while encoding is the source's)."""
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        value = field.contents()
        if vocab is not None and key == "tokenizer.ggml.tokens":
            value = [*value, *(f"x{i}" for i in range(vocab - len(value)))]
        elif vocab is not None and key == "tokenizer.ggml.token_type":
            value = [*value, *([int(gguf.TokenType.NORMAL)] * (vocab - len(value)))]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, field.types[-1])
        else:
            writer.add_key_value(key, value, kind)


QWEN2 = {"hidden": 896, "inter": 4864, "layers": 24, "heads": 14, "kv_heads": 2}


def write_qwen2(out: Path, tokenizer_gguf: Path, seed: int = 0, vocab: int = VOCAB, kind: str = "f16") -> None:
    """Qwen2.5-0.5B's shapes in F16 or Q8_0 (see the module docstring); ``vocab`` rows of the embedding (Qwen2.5's
    own 151,936: the tokenizer padded to it)."""
    rng = np.random.default_rng(seed)
    hidden, inter, layers = QWEN2["hidden"], QWEN2["inter"], QWEN2["layers"]
    heads, kv_heads = QWEN2["heads"], QWEN2["kv_heads"]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_name("specchat bench qwen2 0.5B-shape f16")
    writer.add_block_count(layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    copy_tokenizer(writer, tokenizer_gguf, vocab if vocab != VOCAB else None)

    def normal(rows: int, cols: int) -> np.ndarray:
        weights = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        if kind == "f16":
            return weights.astype(np.float16)
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)

    def add(name: str, rows: int, cols: int) -> None:
        data = normal(rows, cols)
        raw = None if kind == "f16" else gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, data, raw_dtype=raw)

    ones = np.ones(hidden, dtype=np.float32)
    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        writer.add_tensor(f"blk.{i}.attn_q.bias", np.zeros(heads * head_dim, dtype=np.float32))
        for name in ("attn_k", "attn_v"):
            add(f"blk.{i}.{name}.weight", kv_heads * head_dim, hidden)
            writer.add_tensor(f"blk.{i}.{name}.bias", np.zeros(kv_heads * head_dim, dtype=np.float32))
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def write(kind: str, out: Path, tokenizer_gguf: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"specchat bench 1B {kind}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if kind == "q4_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    copy_tokenizer(writer, tokenizer_gguf)
    ones = np.ones(HIDDEN, dtype=np.float32)
    for name, type_name in plan(kind).items():
        rows, cols = shape_of(name)
        writer.add_tensor(name, MAKERS[type_name](rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[type_name])
        if name.endswith("attn_q.weight"):
            layer = name.split(".")[1]
            writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
            writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="an architecture's real shapes, "
                        "in F16 (see gguf_archs.py); --arch and --type are then ignored")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None, help="--shape: keep this many layers")
    parser.add_argument("--window", type=int, default=None, help="--shape: the sliding window (0: none)")
    parser.add_argument("--type", choices=("q4_0", "q4_k_m", "f16", "q8_0"), default=None,
                        help="llama: q4_0 or q4_k_m; qwen2: f16 (quantise it with llama-quantize) or q8_0")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=None, help="qwen2, --shape: the vocabulary (151936: Qwen2.5's "
                        "own; the tokenizer is padded to it; --shape: default the shape's own)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="the file to write (under /tmp: ~0.6-0.7 GB)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a GGUF to copy the tokenizer from "
                        "(default: the embedded model's)")  # fmt: skip
    args = parser.parse_args(argv)
    source = args.tokenizer
    if source is None:
        from specchat.backend.models.loading.pair import packaged_gguf_path

        source = packaged_gguf_path()
    if args.shape is not None:
        write_shape(args.shape, args.out, source, layers=args.layers, vocab=args.vocab, window=args.window)
        print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")
        return 0
    if args.type is None:
        parser.error("--type is required without --shape")
    if (args.arch == "qwen2") != (args.type in ("f16", "q8_0")):
        parser.error("--arch qwen2 writes --type f16 or q8_0; --arch llama writes q4_0 or q4_k_m")
    if args.arch == "qwen2":
        write_qwen2(args.out, source, vocab=args.vocab or VOCAB, kind=args.type)
    else:
        write(args.type, args.out, source)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
