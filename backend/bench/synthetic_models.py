"""Random-weight models with real architectures' shapes, for `specchat bench --synthetic` (no download).

Contract: ``SYNTHETIC`` names the pairs (target + draft config fields, draft quantisation, run sizes).
:func:`build_random` builds a config's model directly on the device with initialisation skipped
(``torch.device`` context + transformers' ``no_init_weights``) and then fills it cheaply on the device:
matrices ~ N(0, 0.02), norm weights 1, biases 0 (non-persistent buffers such as RoPE frequencies are computed
by the constructors as usual). :func:`quantize_nf4` swaps a model's linear layers (not the output head) for
bitsandbytes 4-bit NF4 ones. :func:`build_loaded` wraps a model as a :class:`LoadedModel` with a synthetic
word-level tokenizer over the whole vocabulary and no EOS, so generation never stops early.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

LLAMA3_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
LLAMA32_1B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY_TARGET = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
TINY_DRAFT = dict(TINY_TARGET, hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=8)


@dataclass(frozen=True, slots=True)
class SyntheticPair:
    name: str
    description: str
    target: dict  # config fields, model_type included
    draft: dict
    draft_quantization: str  # "nf4" | "none" (nf4 falls back to the compute dtype without bitsandbytes)
    prompt_tokens: int
    new_tokens: int  # default; --max-new-tokens overrides
    repeats: int  # timed repetitions per step size
    bandwidth_bytes: int  # size of the tensor the read bandwidth is measured on


SYNTHETIC: dict[str, SyntheticPair] = {
    "llama3-8b": SyntheticPair(
        "llama3-8b",
        "Llama-3-8B-shaped target (bf16), Llama-3.2-1B-shaped draft in nf4",
        LLAMA3_8B,
        LLAMA32_1B,
        "nf4",
        prompt_tokens=512,
        new_tokens=256,
        repeats=20,
        bandwidth_bytes=4 << 30,
    ),
    "llama3-8b-bf16-draft": SyntheticPair(
        "llama3-8b-bf16-draft",
        "as llama3-8b with the draft in bf16",
        LLAMA3_8B,
        LLAMA32_1B,
        "none",
        prompt_tokens=512,
        new_tokens=256,
        repeats=20,
        bandwidth_bytes=4 << 30,
    ),
    "tiny": SyntheticPair(
        "tiny",
        "two tiny Llamas; runs on CPU in seconds (tests)",
        TINY_TARGET,
        TINY_DRAFT,
        "none",
        prompt_tokens=32,
        new_tokens=12,
        repeats=3,
        bandwidth_bytes=32 << 20,
    ),
}


def build_random(fields: dict, device: torch.device, dtype: torch.dtype, *, seed: int = 0, std: float = 0.02):
    """A causal LM of config ``fields`` on ``device`` in ``dtype``, random weights, initialisation skipped."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), pad_token_id=0, bos_token_id=1, eos_token_id=None, **fields)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    return model.eval()


def quantize_nf4(model, compute_dtype: torch.dtype) -> None:
    """Replace every ``nn.Linear`` except the output head with a bitsandbytes NF4 ``Linear4bit`` (in place)."""
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear) or child is head:
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                quant_type="nf4",
                device="meta",
            )
            weight = child.weight.data
            # bitsandbytes' Params4bit.to is typed for torch.Tensor's self
            q.weight = bnb.nn.Params4bit(weight.to("cpu"), requires_grad=False, quant_type="nf4").to(weight.device)  # type: ignore[misc]
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, child_name, q)


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer whose ids 0..vocab_size-1 decode to " t<id>"; no EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0")


def build_loaded(fields: dict, device: torch.device, *, seed: int, quantization: str, notes: list[str] | None = None):
    """(LoadedModel, the default PairConfig to derive a synthetic pair from) for config ``fields``."""
    from specchat.backend.models.catalog.config import default_pair_name, load_pairs
    from specchat.backend.models.loading.pair import LoadedModel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random(fields, device, dtype, seed=seed)
    quant = "none"
    if quantization == "nf4":
        try:
            quantize_nf4(model, dtype)
            quant = "nf4"
        except ImportError:
            (notes if notes is not None else []).append(
                f"bitsandbytes is not importable: the draft runs in {str(dtype).removeprefix('torch.')}, not nf4"
            )
    pairs = load_pairs()
    base = pairs[default_pair_name(pairs)]
    spec = dataclasses.replace(
        base.local_target, source=f"synthetic:{fields['model_type']}-{fields['hidden_size']}", quantization=quant
    )
    loaded = LoadedModel(
        model=model,
        tokenizer=synthetic_tokenizer(fields["vocab_size"]),
        spec=spec,
        device=device,
        dtype=dtype,
        generation_config={},
    )
    return loaded, base


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters one decode step reads: all of them but an untied input embedding (one row read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or emb.weight is not head.weight:
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def llama_params(fields: dict) -> int:
    """Parameter count of a Llama-shaped config (embedding, layers, final norm, an untied head)."""
    h, inter, layers = fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"]
    heads, kv, hd = fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter + 2 * h
    embeddings = fields["vocab_size"] * h * (1 if fields.get("tie_word_embeddings") else 2)
    return embeddings + layers * per_layer + h


def synthetic_bytes(pair: SyntheticPair, device: torch.device) -> int:
    """Memory ``measure`` needs on ``device``: both models in the compute dtype (an nf4 draft counted unquantized,
    an upper bound), the bandwidth tensor, and a tenth more for activations, caches and allocator slack."""
    dtype_bytes = 2 if device.type == "cuda" else 4
    weights = (llama_params(pair.target) + llama_params(pair.draft)) * dtype_bytes
    return int((weights + pair.bandwidth_bytes) * 1.1)
