"""Tiny random-weight causal LMs, one per supported family, built from a config in code (no download).

Contract: ``build_tiny(family, seed=0, attn_implementation="eager", **overrides)`` returns a float32 model in
eval mode whose weights depend only on (family, seed, overrides). Every family has hidden size 64, 2 layers,
4 query heads over 2 KV heads (grouped-query attention), head_dim 16 and a vocabulary of ``VOCAB_SIZE``
ids; the families with sliding-window attention get a window of ``WINDOW`` tokens, so a context of a few
dozen tokens already exercises it. Weights are drawn with a larger standard deviation than the stock 0.02
(``INIT_STD``) so logits are spread out and greedy argmax comparisons do not sit on near-ties.

``FAMILIES`` lists the family names; ``tiny_config(family, **overrides)`` gives the config alone (for cache
sizing tests that need no weights). ``one_thread`` is a fixture: import it into a test module
(``from tiny_models import one_thread  # noqa: F401``) to run that module's tests with one torch thread,
which is much faster for tiny tensors on a busy machine (two intra-op threads wait on each other's barrier
for milliseconds when other processes hold the cores).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

VOCAB_SIZE = 128
WINDOW = 8
INIT_STD = 0.1

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Per family: (model_type, extra config fields). The comments say which attention feature each one tests.
_FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # Plain causal attention (SmolLM2 is a Llama).
    "llama": ("llama", {}),
    # One sliding window for every layer.
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    # qkv bias; sliding window on layers >= max_window_layers only (layer 0 full, layer 1 sliding).
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    # q/k norm; full attention (the common Qwen3 setting).
    "qwen3": ("qwen3", {}),
    # Logit softcapping (small cap so it changes the result), alternating sliding / full layers,
    # query_pre_attn_scalar scaling, final logit softcapping.
    "gemma2": (
        "gemma2",
        {
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 24,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    # Local (sliding) then global layer, per-layer rope, q/k norm, query_pre_attn_scalar.
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
    # Fused qkv / gate_up projections; sliding window from the config on every layer.
    "phi3": ("phi3", {"sliding_window": WINDOW}),
    # A multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration) fed text only: the gemma3 text fields
    # above go into its text_config (see tiny_config), plus a one-layer vision tower that text never touches.
    "gemma3_mm": ("gemma3", {}),
}
_VISION_TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)

FAMILIES: tuple[str, ...] = tuple(_FAMILY_CONFIGS)


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``family`` (one of ``FAMILIES``), with ``overrides`` applied on top."""
    if family not in _FAMILY_CONFIGS:
        raise KeyError(f"unknown tiny family {family!r}; known: {', '.join(FAMILIES)}")
    model_type, extra = _FAMILY_CONFIGS[family]
    if family == "gemma3_mm":
        text = {**_COMMON, **_FAMILY_CONFIGS["gemma3"][1], **overrides}
        return AutoConfig.for_model(model_type, text_config=text, vision_config=_VISION_TINY, mm_tokens_per_image=4)
    fields = {**_COMMON, **extra, **overrides}
    return AutoConfig.for_model(model_type, **fields)


def build_tiny(family: str, *, seed: int = 0, attn_implementation: str = "eager", **overrides: Any) -> PreTrainedModel:
    """A float32, eval-mode random-weight model of ``family``; same (family, seed, overrides) -> same weights."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def random_ids(n: int, *, seed: int = 0, low: int = 3) -> list[int]:
    """``n`` token ids drawn uniformly from [low, VOCAB_SIZE) (ids below ``low`` are pad/bos/eos)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB_SIZE, (n,), generator=gen).tolist()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run the test with one intra-op torch thread, restoring the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# SmolLM2-135M's attention shape (9 query heads of 64 over 3 KV heads): where a batched masked attention's rows
# differ from one-token passes in the last bits (the tiny default shape happens not to show it).
SMOLLM_ATTENTION = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def quantised_paged(family: str, quantization: str = "int4-torch", **overrides) -> PreTrainedModel:
    """A tiny ``family`` model quantised as ``quantization`` on CPU, switched to paged attention."""
    from specchat.backend.kv import attention
    from specchat.backend.models.loading.quantized import quantize_model

    model = build_tiny(family, **overrides)
    quantize_model(model, quantization, torch.device("cpu"))
    attention.use_paged_attention(model)
    return model


def tiny_paged_cache(model):
    """A 256-token bfloat16 paged cache on CPU for ``model``, in the engine's blocks (the default size)."""
    from specchat.backend.kv.kv_cache import PagedKVCache

    return PagedKVCache.for_model(model.config, max_tokens=256, dtype=torch.bfloat16, device="cpu")
