"""Esc during a long prefill (issue 36: it took 4.1 s to act, one 512-token pass on a busy CPU): a cancel set
while a prefill pass runs stops it before its next decoder layer, keeps nothing of that pass, and changes no
number any completed pass computes; the last progress event says how much of the prompt was read."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_fixtures import tiny_engine
from paged import paged_forward
from tiny_models import quantised_paged, random_ids, tiny_paged_cache

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.kernels import compact
from specchat.backend.kv.attention import PassCancelled
from specchat.backend.limits import PREFILL_CHUNK

PROMPT = random_ids(2 * PREFILL_CHUNK + 100, seed=9)
SAMPLING = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8, seed=21)


def _kv(engine, key: str) -> list[torch.Tensor]:
    """The K and V the conversation ``key`` holds for the prompt's positions, for every layer (the reply's own
    positions are written by verification passes whose γ the policy picks from measured times)."""
    seq = engine._conversations[key].seq
    slots = torch.tensor([seq.slot(i) for i in range(len(PROMPT))])
    return [pool[:, :, slots] for pool in (*engine.cache.k_layers, *engine.cache.v_layers)]


def _request(progress: bool = True) -> GenerationRequest:
    return GenerationRequest(prompt_ids=PROMPT, sampling=SAMPLING, conversation="c", prefill_progress=progress)


def test_a_cancel_inside_a_pass_keeps_nothing_of_it_and_changes_no_number():
    engine = tiny_engine("llama", context_length=4096)
    cancel = threading.Event()
    passes = []

    def second_layer(module, args):  # the cancel comes while the third pass is between its two layers
        passes.append(args[0].shape[1])
        if len(passes) == 2 * 2 + 2:  # pass 1: layers 0, 1; pass 2: layers 0, 1; pass 3: layer 0, then...
            cancel.set()

    hooks = [layer.register_forward_pre_hook(second_layer) for layer in engine.target.model.model.layers]
    events = list(engine.generate(_request(), cancel))
    for hook in hooks:
        hook.remove()
    assert events[-1].finish_reason == "cancelled" and not any(e.token_ids for e in events)
    conv = engine._conversations["c"]
    assert len(conv.cached) == conv.seq.length == 2 * PREFILL_CHUNK  # the third pass stopped: none of it kept
    assert events[-2].prefill_done == 2 * PREFILL_CHUNK and events[-2].prefill_tokens == len(PROMPT)  # "N of M"

    again = [t for e in engine.generate(_request()) for t in e.token_ids]  # the next request reads the rest
    fresh = tiny_engine("llama", context_length=4096)
    whole = [t for e in fresh.generate(_request(progress=False)) for t in e.token_ids]
    assert again == whole
    for a, b in zip(_kv(engine, "c"), _kv(fresh, "c"), strict=True):
        assert torch.equal(a, b)  # bit for bit: the stopped pass left no trace


def test_the_compact_forward_stops_between_layers_too():
    model = quantised_paged("llama", head_dim=32)
    fast = compact.build(model)
    seq = tiny_paged_cache(model).new_sequence()
    cancel = threading.Event()
    reference = paged_forward(model, seq, random_ids(40, seed=1), fast=fast, cancel=cancel)  # not set: runs
    cancel.set()
    with pytest.raises(PassCancelled):
        paged_forward(model, seq, random_ids(40, seed=1), fast=fast, cancel=cancel)
    cancel.clear()
    seq.truncate(seq.length)  # what the request does after a cancelled pass
    again = paged_forward(model, seq, random_ids(40, seed=1), fast=fast, cancel=cancel)
    assert torch.equal(again, reference)


def test_esc_during_a_long_prefill_acts_within_half_a_second():
    """A 30-layer model reading 2,692 tokens at 8 ms a token (4.1 s a pass, the reporter's figure); Esc 1 s into
    the first pass: the reply ends within 0.5 s (one layer is 0.14 s), nothing of the pass kept."""
    engine = tiny_engine("llama", context_length=4096, num_hidden_layers=30)
    layers = engine.target.model.model.layers
    per_token_layer_s = 4.1 / PREFILL_CHUNK / len(layers)

    def slow(module, args):
        time.sleep(per_token_layer_s * args[0].shape[1])

    for layer in layers:
        layer.register_forward_pre_hook(slow)
    cancel = threading.Event()
    cancelled_at: list[float] = []

    def esc() -> None:
        cancelled_at.append(time.monotonic())
        cancel.set()

    timer = threading.Timer(1.0, esc)
    timer.start()
    request = GenerationRequest(
        prompt_ids=random_ids(2692, seed=5),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=4),
        conversation="c",
        prefill_progress=True,
    )
    events = list(engine.generate(request, cancel))
    latency = time.monotonic() - cancelled_at[0]
    assert events[-1].finish_reason == "cancelled"
    assert latency < 0.5, f"the cancel acted {latency:.2f} s after Esc"
    assert engine._conversations["c"].seq.length == 0 and events[-2].prefill_done == 0  # stopped in pass one
