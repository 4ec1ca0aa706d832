"""Test material for config/loading/memory tests: tiny tokenizers, tiny checkpoints on disk, a tiny GGUF file.

- ``word_tokenizer(words, **special)``: a WordLevel ``PreTrainedTokenizerFast`` over ``SPECIALS + words``.
- ``save_tiny_llama(folder, tokenizer, vocab_size, ...)``: a random-weight Llama (hidden 64, 2 layers) plus the
  tokenizer, saved as safetensors; returns the model.
- ``local_spec(folder, model, **fields)``: a ModelSpec (kind "local") whose numbers are the model's.
- ``write_tiny_gguf(path, seed)``: a float32 Llama GGUF with a byte-level BPE tokenizer (gguf's writer), that
  transformers loads with ``gguf_file=``.
- ``isolated_dirs``: a fixture pointing SPECCHAT_{CONFIG,CACHE,DATA}_DIR at a temporary folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from specchat.backend.models.catalog.config import ModelSpec

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


@pytest.fixture
def isolated_dirs(tmp_path, monkeypatch) -> Path:
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / "specchat" / name.lower()))
    return tmp_path / "specchat"


def word_tokenizer(words: list[str], *, order: list[str] | None = None, eos: str = "</s>"):
    """Whitespace-split words, each one token; ``order`` lists every token in id order (default SPECIALS+words)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tokens = order if order is not None else SPECIALS + words
    backend = Tokenizer(WordLevel({tok: i for i, tok in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token=eos, pad_token="<pad>"
    )


def save_tiny_llama(folder: Path, tokenizer, vocab_size: int, *, seed: int = 0, dtype=torch.float32, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def local_spec(folder: Path, model, **fields) -> ModelSpec:
    config = model.config
    spec = ModelSpec(
        source=str(folder),
        kind="local",
        revision=None,
        dtype="float32",
        quantization="none",
        params=sum(p.numel() for p in model.parameters()),
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        download_bytes=0,
        gated=False,
        tie_word_embeddings=config.tie_word_embeddings,
        path=str(folder),
    )
    return dataclasses.replace(spec, **fields)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (the tokens of a byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    weights: str = "F32",
    embedding: str = "F32",
) -> Path:
    """A Llama GGUF (random weights) with a 262-token byte-level BPE tokenizer; the decoder's linear weights
    stored as ``weights`` and the token embedding as ``embedding`` (ggml type names: F32, F16, Q4_0, Q4_1,
    Q8_0)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_level_alphabet(), "Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    head_dim = hidden // heads

    def tensor(name: str, shape: tuple[int, ...], kind: str = weights) -> None:
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, values)
        elif kind == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (len(tokens), hidden), embedding)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        tensor(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim))
        tensor(f"blk.{i}.ffn_gate.weight", (intermediate, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (intermediate, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, intermediate))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
