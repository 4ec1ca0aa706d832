"""Hidden-state taps (``ModelRunner.forward(..., taps=...)``): what a draft head reads from the target's pass.

A tap index is transformers' ``output_hidden_states`` index (the stream entering layer i; the number of layers:
the final normed state). Both forwards that exist here return them for every row, and asking for them changes
no logit: a reply must not depend on whether its drafter reads taps.
"""

from __future__ import annotations

import pytest
import torch
from paged import paged_forward
from tiny_models import build_tiny, random_ids
from tiny_models import quantised_paged as _quantised
from tiny_models import tiny_paged_cache as _cache

from specchat.backend.kernels import compact
from specchat.backend.kv import attention
from specchat.backend.kv.block_pool import KVCacheUsageError

TAPS = (0, 1, 2)  # the tiny models have 2 layers: embeddings, after layer 0, final normed


def _reference_states(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' own hidden states for ``ids`` from position 0 (its stock attention, no paged cache)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return tuple(h[0].float() for h in out.hidden_states)


def test_transformers_path_returns_its_hidden_states():
    model = build_tiny("llama")
    ids = random_ids(20, seed=1)
    expected = _reference_states(model, ids)
    attention.use_paged_attention(model)
    seq = _cache(model).new_sequence()
    logits, hidden = paged_forward(model, seq, ids[:12], logits_to_keep=12, taps=TAPS)
    seq.commit(12)
    _, more = paged_forward(model, seq, ids[12:], logits_to_keep=1, taps=TAPS)
    hidden = torch.cat([hidden, more])  # [20, 3 * 64]
    assert hidden.shape == (20, 3 * 64) and logits.shape[0] == 12
    for k, tap in enumerate(TAPS):
        torch.testing.assert_close(
            hidden[:, k * 64 : (k + 1) * 64], expected[tap], atol=2e-2, rtol=2e-2
        )  # eager vs paged SDPA rounding


@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 1]])
def test_compact_taps_leave_the_logits_alone_and_match_transformers(parents):
    model = _quantised("llama", head_dim=32)
    fast = compact.build(model)
    prompt, step = random_ids(30, seed=2), random_ids(5, seed=3)
    seqs = [_cache(model).new_sequence() for _ in range(3)]
    for seq in seqs:
        paged_forward(model, seq, prompt, fast=fast)
        seq.commit(len(prompt))
    plain = paged_forward(model, seqs[0], step, logits_to_keep=5, fast=fast, parents=parents)
    logits, hidden = paged_forward(model, seqs[1], step, logits_to_keep=5, fast=fast, parents=parents, taps=TAPS)
    assert torch.equal(plain, logits)  # bit for bit: taps are copies taken between layers
    ref_logits, ref_hidden = paged_forward(model, seqs[2], step, logits_to_keep=5, parents=parents, taps=TAPS)
    torch.testing.assert_close(hidden, ref_hidden, atol=2e-2, rtol=2e-2)
    assert hidden.shape == (5, 3 * 64)


def test_a_tap_the_model_lacks_is_refused():
    model = build_tiny("llama")
    attention.use_paged_attention(model)
    seq = _cache(model).new_sequence()
    with pytest.raises(KVCacheUsageError, match="taps"):
        paged_forward(model, seq, [5, 6], taps=(3,))
