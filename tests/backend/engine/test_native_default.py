"""The embedded default (SmolLM2-135M-Instruct, its GGUF's Q4_1 blocks) on the CPU native model, through the engine
as `specchat` runs it: the start line names the path; greedy output is the same for every drafter and γ (chains
and trees of drafts, a native draft model); a seeded sampled reply replays the same for every drafter and γ;
the hidden-state taps come with the logits.

These are the slow tests of the default on the path users get: with a C++ compiler (CI has one) the native
path must run; without one the tests are skipped and say why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine, load_engine
from specchat.backend.kernels import native_build
from specchat.backend.kv.attention import ATTN_IMPLEMENTATION
from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.loading.pair import load_model

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
EDIT = [
    {
        "role": "user",
        "content": (
            "Rename the parameter `xs` to `values` in this function and return the whole function:\n\n"
            "```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
            "    return total / len(xs)\n```"
        ),
    }
]


@pytest.fixture(scope="module")
def engine():
    why = native_build.unavailable()
    if why is not None:
        pytest.skip(f"the CPU native model cannot be built here: {why}")
    engine = load_engine(load_pairs()["smollm2-135m"], device="cpu")
    assert engine.runner.path == "cpu-native", engine.start_line
    return engine


@pytest.fixture(scope="module")
def twin_engine(engine):
    """The default with itself as a draft model (both native): drafts that verification mostly accepts."""
    pair = load_pairs()["smollm2-135m"]
    target = load_model(pair.target, "cpu", attn_implementation=ATTN_IMPLEMENTATION)
    draft = load_model(pair.target, "cpu", attn_implementation=ATTN_IMPLEMENTATION)
    twin = dataclasses.replace(pair, name="native-twin", drafter="draft-model", draft=pair.target)
    built = Engine(target, draft, twin)
    assert built.runner.path == built.draft_runner.path == "cpu-native"
    return built


def _ids(engine, messages, **kwargs):
    ids, last = [], None
    for event in engine.generate(GenerationRequest(messages=messages, **kwargs)):
        ids.extend(event.token_ids)
        last = event
    return ids, last


def test_the_start_line_names_the_path(engine):
    assert engine.start_line.startswith("CPU native (") and engine.start_line.endswith("Q4_1, Q8_0 as stored")
    assert engine.fallback_reason is None


@pytest.mark.parametrize("messages", [CHAT, EDIT], ids=["chat", "edit"])
def test_greedy_output_is_the_same_for_every_drafter(twin_engine, messages):
    greedy = SamplingParams(temperature=0, max_new_tokens=40)
    plain, _ = _ids(twin_engine, messages, sampling=greedy, drafter="none")
    for drafter, gamma in [("prompt-lookup", 4), ("prompt-lookup", "auto"), ("suffix", 12), ("draft-model", 5)]:
        ids, last = _ids(twin_engine, messages, sampling=greedy, drafter=drafter, gamma=gamma)
        assert ids == plain, (drafter, gamma)
    assert "Paris" in twin_engine.tokenizer.decode(plain) or messages is not CHAT


def test_a_seeded_reply_replays_for_every_drafter_and_gamma(twin_engine):
    sampling = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=32, seed=11)
    first, _ = _ids(twin_engine, EDIT, sampling=sampling, drafter="none")
    for drafter, gamma in [("prompt-lookup", 2), ("prompt-lookup", 8), ("suffix", "auto"), ("draft-model", 3)]:
        ids, _ = _ids(twin_engine, EDIT, sampling=sampling, drafter=drafter, gamma=gamma)
        assert ids == first, (drafter, gamma)


def test_taps_come_with_the_logits(engine):
    runner = engine.runner
    seq = runner.cache.new_sequence()
    try:
        ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
        logits = runner.forward(seq, ids, logits_to_keep=2).logits
        again = runner.forward(seq, ids, taps=(3, 16, 30), logits_to_keep=2)
        assert torch.equal(logits, again.logits)
        assert again.hidden is not None and tuple(again.hidden.shape) == (len(ids), 3 * 576)
        assert torch.isfinite(again.hidden).all()
    finally:
        seq.free()


def test_a_long_prompt_reads_in_native_chunks_with_the_logits_of_one_pass(engine, monkeypatch):
    """The native model prefills NATIVE_PREFILL_CHUNK rows a pass (its buffers are sized by them): the prompt's last
    row, and the greedy reply after it, are bit for bit what one pass over the whole prompt gives."""
    from specchat.backend.engine import runner as runner_module
    from specchat.backend.limits import NATIVE_PREFILL_CHUNK

    assert engine.runner.prefill_chunk == NATIVE_PREFILL_CHUNK
    words = " ".join(f"item {i} of the list, then" for i in range(90))
    messages = [{"role": "user", "content": f"Repeat the last item: {words}"}]
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    chunked, last = _ids(engine, messages, sampling=greedy, drafter="none")
    assert last is not None and last.stats.prompt_tokens > 3 * NATIVE_PREFILL_CHUNK
    monkeypatch.setattr(runner_module, "NATIVE_PREFILL_CHUNK", 4096)  # the whole prompt in one pass
    whole, _ = _ids(engine, messages, sampling=greedy, drafter="none")
    assert chunked == whole
