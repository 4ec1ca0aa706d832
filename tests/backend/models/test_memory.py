"""The memory estimate: its arithmetic, the fits/does-not-fit check, and agreement (within 15%) with the memory
that loading really takes, for tiny models (float32, bfloat16, nf4) and for the embedded default."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from foundation_fixtures import local_spec, save_tiny_llama, word_tokenizer

from specchat.backend.errors import InsufficientMemoryError
from specchat.backend.kernels.cuda_graphs import DEFAULT_TOKEN_BUCKETS, static_bytes
from specchat.backend.limits import DEFAULT_PAIR, MAX_GAMMA
from specchat.backend.models.catalog.config import PairConfig, load_pairs
from specchat.backend.models.facts import memory
from specchat.backend.models.facts.memory import MemoryEstimate, check_fits, estimate_pair, free_memory
from specchat.backend.models.loading.pair import load_model, load_pair

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # estimates need no GPU: only the device type counts
_CALLER_CACHE = os.environ.get("SPECCHAT_CACHE_DIR")


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def pair_of(target, draft=None, context_length=1024) -> PairConfig:
    return PairConfig(
        name="p",
        description="",
        target=target,
        drafter="draft-model" if draft else "prompt-lookup",
        draft=draft,
        gamma="auto",
        context_length=context_length,
        sampling={},
        source_file="f.yaml",
    )


def within(measured: int, estimated: int, tolerance: float = 0.15) -> bool:
    return abs(measured - estimated) <= tolerance * measured


def kv_allocation(spec, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """What a KV cache for ``tokens`` really allocates (zeros: every page touched)."""
    return torch.zeros(spec.num_layers, 2, spec.num_kv_heads, tokens, spec.head_dim, dtype=dtype)


def tensor_bytes(model) -> int:
    """Parameter and buffer storage, plus bitsandbytes' 4-bit block scales (kept beside the packed weights)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
    return total


# --- arithmetic --------------------------------------------------------------------------------------------


def test_estimate_terms(monkeypatch):
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")  # the float32 path (the native one: test_memory_native.py)
    shipped = load_pairs()
    pair = shipped["smollm2-135m-f32"]
    s = pair.target
    cpu = estimate_pair(pair, CPU)
    assert cpu.target_weights == s.params * 4 and cpu.draft_weights == 0 and cpu.draft_kv == 0
    assert cpu.target_kv == s.num_layers * 2 * s.num_kv_heads * s.head_dim * 4 * pair.context_length
    subtotal = cpu.target_weights + cpu.target_kv + cpu.scratch
    assert cpu.headroom == int(subtotal * 0.08) and cpu.total == subtotal + cpu.headroom
    gpu = estimate_pair(pair, CUDA)
    assert gpu.target_weights == s.params * 2 and gpu.target_kv == cpu.target_kv // 2
    short = estimate_pair(pair, CPU, context_length=1024)
    assert short.target_kv * 8 == cpu.target_kv and short.total < cpu.total
    qwen = shipped["qwen2.5-7b"]
    est = estimate_pair(qwen, CUDA)
    assert est.draft_weights < qwen.draft.params * 2 / 2  # nf4 draft: well under half its bf16 size
    assert est.draft_kv == 24 * 2 * 2 * 64 * 2 * qwen.context_length
    big = estimate_pair(shipped["qwen2.5-14b-nf4"], CUDA)
    assert 8e9 < big.target_weights < 11e9  # 14.8B params in nf4, embeddings and head in bf16
    assert "KV caches" in est.describe(qwen.context_length)


def test_estimate_counts_the_logits_rows_and_the_cuda_graphs():
    """Issue 14, defect 8: bcb0966's estimate had no CUDA-graph term (the runner then kept float32 logits per
    shape, ~1.2 GB for Qwen2.5-7B at 8k context) and counted 17 rows x 8 bytes of logits scratch, not the
    decision's copies and noise at the largest γ."""
    qwen = load_pairs()["qwen2.5-7b"]
    s = qwen.target
    gpu, cpu = estimate_pair(qwen, CUDA), estimate_pair(qwen, CPU)
    assert cpu.graphs == 0 and gpu.graphs >= static_bytes(s.vocab_size, qwen.context_length)
    assert static_bytes(s.vocab_size, qwen.context_length) >= DEFAULT_TOKEN_BUCKETS[-1] * s.vocab_size * 4
    subtotal = gpu.target_weights + gpu.draft_weights + gpu.target_kv + gpu.draft_kv + gpu.scratch + gpu.graphs
    assert gpu.total == subtotal + gpu.headroom and "CUDA graphs" in gpu.describe(qwen.context_length)
    rows = memory.LOGIT_ROWS * s.vocab_size * (2 + memory.DECISION_BYTES)  # bf16 output + decision copies
    rows += memory.PICK_ROWS * s.vocab_size * memory.NOISE_BYTES  # the noise of the rows drawn at once
    assert memory.LOGIT_ROWS == MAX_GAMMA + 1 and gpu.scratch >= rows
    assert memory.scratch_bytes(s, CUDA, qwen.context_length) - rows == memory.scratch_bytes(
        dataclasses.replace(s, vocab_size=0), CUDA, qwen.context_length
    )


def test_free_memory_is_plausible():
    free = free_memory(CPU)
    total = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < free <= total


def test_check_fits_refuses_with_the_numbers(monkeypatch):
    pair = load_pairs()["qwen2.5-7b"]
    monkeypatch.setattr(memory, "free_memory", lambda device: 8 * 2**30)
    with pytest.raises(InsufficientMemoryError) as info:
        check_fits(pair, CUDA)
    message = str(info.value)
    estimate = estimate_pair(pair, CUDA)
    for part in (
        "qwen2.5-7b",
        memory.format_bytes(estimate.total),
        "8 GiB is free",
        "context_length",
        "target weights",
        "KV caches",
    ):
        assert part in message, message
    monkeypatch.setattr(memory, "free_memory", lambda device: 10 * 2**40)
    assert isinstance(check_fits(pair, CUDA), MemoryEstimate)


# --- estimate vs measured ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, quantization", [("float32", "none"), ("bfloat16", "none"), ("float32", "nf4")])
def test_tiny_model_estimate_matches_measured(tmp_path, dtype, quantization):
    if quantization != "none":
        pytest.importorskip("bitsandbytes")
    tok = word_tokenizer([f"w{i}" for i in range(60)])
    model = save_tiny_llama(tmp_path / "m", tok, 64, tie=False)
    spec = local_spec(tmp_path / "m", model, dtype=dtype, quantization=quantization)
    loaded = load_model(spec, CPU)
    kv = kv_allocation(spec, 256, loaded.dtype)
    measured_weights = tensor_bytes(loaded.model)
    estimate = estimate_pair(pair_of(spec, context_length=256), CPU)
    assert within(measured_weights, estimate.target_weights), (measured_weights, estimate.target_weights)
    assert within(measured_weights + kv.nbytes, estimate.target_weights + estimate.target_kv)


@pytest.mark.slow
def test_embedded_default_estimate_matches_measured(monkeypatch):
    """Loaded weights + a real KV allocation vs the estimate; then the process's RSS growth (a fresh
    subprocess: load, one 512-token forward, a 512-token KV cache) vs the estimate's total at that context. The
    transformers paths (SPECCHAT_NATIVE=0), as load_pair loads them outside the engine."""
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")
    if _CALLER_CACHE:
        monkeypatch.setenv("SPECCHAT_CACHE_DIR", _CALLER_CACHE)
    else:
        monkeypatch.delenv("SPECCHAT_CACHE_DIR", raising=False)
    pair = load_pairs()[DEFAULT_PAIR]
    target, _ = load_pair(pair, CPU)
    kv = kv_allocation(pair.target, pair.context_length, target.dtype)
    estimate = estimate_pair(pair, CPU)
    measured = tensor_bytes(target.model) + kv.nbytes
    assert within(measured, estimate.target_weights + estimate.target_kv), (measured, estimate)
    del target, kv

    script = textwrap.dedent("""
        import gc, json, torch
        import transformers.models.llama.modeling_llama  # imports are code, not the model's memory
        from specchat.backend.limits import DEFAULT_PAIR
        from specchat.backend.models.catalog.config import load_pairs
        from specchat.backend.models.loading.pair import load_pair
        from specchat.backend.models.facts.memory import estimate_pair
        def rss():
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
        pair = load_pairs()["smollm2-135m-f32"]  # float32: the weights dominate the process's growth
        s = pair.target
        torch.nn.functional.scaled_dot_product_attention(*(torch.randn(1, 2, 4, 8),) * 3)  # warm the kernels
        gc.collect(); before = rss()
        target, _ = load_pair(pair, "cpu")
        with torch.no_grad():
            target.model(torch.randint(0, s.vocab_size, (1, 512)), use_cache=False)
        kv = torch.zeros(s.num_layers, 2, s.num_kv_heads, 512, s.head_dim)
        gc.collect()
        print(json.dumps({"rss": rss() - before, "estimate": estimate_pair(pair, torch.device("cpu"), 512).total}))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=os.environ.copy(), timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert within(numbers["rss"], numbers["estimate"]), numbers


def test_int4_default_counts_its_own_bytes(monkeypatch):
    """int4 linears (half a byte + a bfloat16 scale and zero per 32), the Q8_0 embedding, an int8 head; KV in
    bfloat16: the default's weights are under a quarter of float32's (where the native model does not run it)."""
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")
    pair = load_pairs()[DEFAULT_PAIR]
    s = pair.target
    assert s.quantization == "int4-torch"
    embedding = s.vocab_size * s.hidden_size
    expected = (s.params - embedding) * (0.5 + 4 / 32) + embedding * (1 + 4 / 32) + embedding * (1 + 2 / 576)
    cpu = estimate_pair(pair, CPU)
    assert cpu.target_weights == int(expected) and cpu.target_weights * 4 < s.params * 4
    assert cpu.target_kv == s.num_layers * 2 * s.num_kv_heads * s.head_dim * 2 * pair.context_length


# --- `specchat models` -------------------------------------------------------------------------------------


def test_models_command_lists_every_pair_with_its_estimate(monkeypatch):
    import io
    from types import SimpleNamespace

    from specchat.app.cli import models as cmd_models
    from specchat.backend.errors import ConfigError

    monkeypatch.setattr(memory, "free_memory", lambda device: 4 * 2**30)
    out = io.StringIO()
    assert cmd_models.run(SimpleNamespace(models=None, device="cpu", pair=None), out) == 0
    text = out.getvalue()
    pairs = load_pairs()
    heads = {  # each pair's block starts with its name (after "* " for the default) and its estimate
        line[2:].split()[0]: line for line in text.splitlines() if line[:2] in ("* ", "  ") and line[2:3].strip()
    }
    assert set(pairs) <= set(heads)
    assert heads[DEFAULT_PAIR].startswith("* ") and "packaged:smollm2-135m-instruct" in text
    for name, pair in pairs.items():
        estimate = estimate_pair(pair, CPU)
        if not estimate.known:
            assert "memory known after the download" in heads[name], heads[name]
            continue
        assert memory.format_bytes(estimate.total) in heads[name], heads[name]
        assert ("does NOT fit" in heads[name]) == (estimate.total > 4 * 2**30), heads[name]
    assert "Qwen/Qwen2.5-0.5B-Instruct, quantization nf4" in text and "hf auth login" in text
    assert "4 GiB free" in text
    out = io.StringIO()
    cmd_models.run(SimpleNamespace(models=None, device="cpu", pair="qwen2.5-7b"), out)
    assert "qwen2.5-7b" in out.getvalue() and DEFAULT_PAIR not in out.getvalue()
    with pytest.raises(ConfigError, match="unknown pair 'nope'"):
        cmd_models.run(SimpleNamespace(models=None, device="cpu", pair="nope"), io.StringIO())
