"""Paged attention on tiny random models of every supported family: chunked prefill, single-token decode and
a verification chunk with rollback give the stock model's full-sequence logits (eager attention, no cache),
over a contiguous block table (zero-copy reads) and over a fragmented one (gathered reads). Also: the
per-forward mask layouts, unsupported architectures refused by name, and misuse errors."""

from __future__ import annotations

import pytest
import torch
from paged import paged_forward
from tiny_models import FAMILIES, build_tiny, random_ids, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

from specchat.backend.errors import KVCacheFullError, ModelLoadError
from specchat.backend.kv.attention import (
    ATTN_IMPLEMENTATION,
    SUPPORTED_ARCHITECTURES,
    PagedContext,
    check_supported,
    use_paged_attention,
)
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import PagedKVCache, SlotPlan

CONTEXT = 40  # > 4 x WINDOW: sliding layers really drop keys
TOL = 1e-4
# Families whose reference output must change when the window (or softcap) is removed: proves the scenario
# exercises the feature, so a paged path ignoring it would fail.
WINDOWED = {"mistral", "qwen2", "gemma2", "gemma3", "gemma3_mm", "phi3"}


def reference_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def make_cache(model, *, fragmented: bool, block_size: int = 4, max_tokens: int = 256) -> PagedKVCache:
    """A cache; when ``fragmented``, every other block is held by a dummy sequence so new ones are not a run."""
    cache = PagedKVCache.for_model(
        model.config, max_tokens=max_tokens, block_size=block_size, dtype=torch.float32, device="cpu"
    )
    if fragmented:
        holders = [cache.new_sequence() for _ in range(cache.pool.num_blocks // 2)]
        for h in holders:
            h.reserve(block_size * 2)  # blocks 2i, 2i+1
            h.commit(block_size * 2)
        for h in holders:
            h.truncate(block_size)  # keeps 2i, frees 2i+1
    return cache


@pytest.mark.parametrize("fragmented", [False, True], ids=["run", "fragmented"])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_logits_equal_stock_model(family: str, fragmented: bool) -> None:
    model = build_tiny(family, attn_implementation="eager")
    ids = random_ids(CONTEXT, seed=7)
    ref = reference_logits(model, ids)
    use_paged_attention(model)
    cache = make_cache(model, fragmented=fragmented)
    seq = cache.new_sequence()
    got: list[torch.Tensor] = []

    # Prefill in three chunks (the first two shorter than, the last crossing, the window).
    for lo, hi in ((0, 6), (6, 17), (17, 26)):
        got.append(paged_forward(model, seq, ids[lo:hi], logits_to_keep=hi - lo))
        seq.commit(hi - lo)
    # Plain decoding, one token per forward.
    for t in ids[26:30]:
        got.append(paged_forward(model, seq, [t]))
        seq.commit(1)
    # Verification chunk: 4 right tokens then 3 wrong drafts; keep one wrong, then roll it back.
    wrong = [(t + 1) % 100 + 3 for t in ids[34:37]]
    logits = paged_forward(model, seq, ids[30:34] + wrong, logits_to_keep=7)
    got.append(logits[:4])
    seq.commit(5)
    seq.truncate(34)
    # Re-forward the true continuation over the rolled-back slots (tensor input this time).
    got.append(paged_forward(model, seq, torch.tensor(ids[34:40]), logits_to_keep=6))
    seq.commit(6)

    assert seq.length == CONTEXT
    if fragmented:
        assert any(b2 != b1 + 1 for b1, b2 in zip(seq.block_table, seq.block_table[1:]))
    else:
        assert seq.block_table == list(range(seq.block_table[0], seq.block_table[0] + len(seq.block_table)))
    torch.testing.assert_close(torch.cat(got), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_scenario_exercises_the_window_and_softcap(family: str) -> None:
    ids = random_ids(CONTEXT, seed=7)
    ref = reference_logits(build_tiny(family), ids)
    no_window = reference_logits(build_tiny(family, sliding_window=4096), ids)  # a window wider than the context
    assert (ref - no_window).abs().max() > 1e-3
    if family == "gemma2":
        no_cap = reference_logits(build_tiny(family, attn_logit_softcapping=None), ids)
        assert (ref - no_cap).abs().max() > 1e-3


@pytest.mark.parametrize("family, fragmented", [("llama", True), ("mistral", False)])
def test_long_chunks_after_a_prefix(family: str, fragmented: bool) -> None:
    model = build_tiny(family)
    ids = random_ids(160, seed=3)
    ref = reference_logits(model, ids)
    use_paged_attention(model)
    seq = make_cache(model, fragmented=fragmented, block_size=16, max_tokens=512).new_sequence()
    first = paged_forward(model, seq, ids[:100], logits_to_keep=100)
    seq.commit(100)
    second = paged_forward(model, seq, ids[100:], logits_to_keep=60)
    torch.testing.assert_close(torch.cat([first, second]), ref, atol=TOL, rtol=0)


def _context(start: int, n: int) -> PagedContext:
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8, dtype=torch.float32, device="cpu")
    return PagedContext(cache, SlotPlan(start, n, start + n, start, None, 0, None))


def test_masks_are_built_only_when_needed_and_once() -> None:
    decode = _context(50, 1)
    assert decode.layout(None, False) == (0, None, False)
    assert decode.layout(8, False) == (43, None, False)  # window: a shorter slice, still no mask
    prefill = _context(0, 20)
    assert prefill.layout(None, False) == (0, None, True)  # SDPA is_causal
    first, mask, causal = prefill.layout(8, False)
    assert (first, causal, mask.shape) == (0, False, (20, 20))
    assert mask[19].tolist() == [False] * 12 + [True] * 8
    verify = _context(30, 4)
    first, mask, causal = verify.layout(None, False)
    assert (first, causal) == (0, False) and mask.sum(1).tolist() == [31, 32, 33, 34]
    assert verify.layout(None, False)[1] is mask  # cached per forward, shared by all layers
    first, blocked, _ = verify.layout(5, True)  # softcap path: the complement, windowed
    assert first == 26 and (~blocked).sum(1).tolist() == [5, 5, 5, 5]


def test_unsupported_architecture_is_refused_by_name() -> None:
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ModelLoadError) as err:
        check_supported(config)
    message = str(err.value)
    assert "'gpt2'" in message and all(name in message for name in SUPPORTED_ARCHITECTURES)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelLoadError, match="gpt2"):
        use_paged_attention(model)
    assert model.config._attn_implementation != ATTN_IMPLEMENTATION


def test_bidirectional_attention_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="bidirectional"):
        check_supported(tiny_config("gemma3", use_bidirectional_attention=True))


def test_misuse_errors() -> None:
    model = build_tiny("llama")
    cache = make_cache(model, fragmented=False)
    seq = cache.new_sequence()
    with pytest.raises(ModelLoadError, match=ATTN_IMPLEMENTATION):
        paged_forward(model, seq, [5, 6])  # not switched to paged attention
    use_paged_attention(model)
    with pytest.raises(KVCacheUsageError, match="forward_paged"):
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6]]))  # paged model called directly
    with pytest.raises(KVCacheUsageError, match="logits_to_keep"):
        paged_forward(model, seq, [5, 6], logits_to_keep=3)
    with pytest.raises(KVCacheUsageError, match="empty"):
        paged_forward(model, seq, [])
    assert (seq.length, seq.block_table) == (0, [])


def test_full_cache_is_reported_and_leaves_the_sequence_usable() -> None:
    model = build_tiny("llama")
    use_paged_attention(model)
    cache = PagedKVCache.for_model(model.config, max_tokens=16, block_size=4, dtype=torch.float32, device="cpu")
    seq = cache.new_sequence()
    ids = random_ids(20, seed=1)
    paged_forward(model, seq, ids[:12], logits_to_keep=1)
    seq.commit(12)
    with pytest.raises(KVCacheFullError, match="KV cache is full"):
        paged_forward(model, seq, ids[12:20])
    assert (seq.length, len(seq.block_table)) == (12, 3)
    logits = paged_forward(model, seq, ids[12:16], logits_to_keep=4)
    torch.testing.assert_close(
        logits, reference_logits(model.set_attn_implementation("eager") or model, ids[:16])[12:], atol=TOL, rtol=0
    )
