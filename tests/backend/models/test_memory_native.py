"""The memory estimate of a model on the CPU native path (backend/models/facts/memory.py): the weights are the file's
blocks as stored, the KV cache float16 for a GGUF, as the loader and the runner really hold them (a GGUF written
here); types without a kernel count at F16; paths that are not native keep their own arithmetic."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gguf_fixtures import gguf_pair
from native_fixtures import native_ready  # noqa: F401  (a fixture)

from specchat.backend.engine.runner import ModelRunner
from specchat.backend.kv.attention import ATTN_IMPLEMENTATION
from specchat.backend.limits import DEFAULT_PAIR
from specchat.backend.models.catalog.config import load_pairs, load_pairs_file
from specchat.backend.models.facts import memory
from specchat.backend.models.gguf.gguf_file import read_gguf
from specchat.backend.models.loading.native_loading import NativeCausalLM
from specchat.backend.models.loading.pair import load_model, packaged_gguf_path

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def _pair(tmp_path: Path, source: Path, extra: str = "", context: int = 256):
    yaml = tmp_path / "models.yaml"
    yaml.write_text(
        f"pairs:\n  - name: p\n    target:\n      source: {source}\n{extra}    context_length: {context}\n",
        encoding="utf-8",
    )
    return load_pairs_file(yaml)["p"]


def test_the_estimate_is_what_the_native_loader_and_runner_hold(tmp_path, native_ready):  # noqa: F811
    """A qwen2 GGUF of Q4_K blocks (F32 norms): the estimate's weights are the file's tensor bytes, which the loaded
    native model holds (its matrices as stored, its norm vectors as float32); the runner's cache is float16."""
    _, path = gguf_pair("qwen2", "Q4_K", tmp_path)
    pair = _pair(tmp_path, path)
    spec = pair.target
    assert memory.as_stored(spec, CPU)
    estimate = memory.estimate_pair(pair, CPU)
    file = read_gguf(path)
    assert estimate.target_weights == sum(t.raw.nbytes for t in file.tensors.values()) == spec.weight_bytes
    loaded = load_model(spec, CPU, attn_implementation=ATTN_IMPLEMENTATION)
    assert isinstance(loaded.model, NativeCausalLM)
    vectors = sum(t.raw.nbytes for t in file.tensors.values() if len(t.shape) == 1)
    assert estimate.target_weights == loaded.model.weight_bytes + vectors
    runner = ModelRunner(loaded, kv_tokens=pair.context_length)
    cache = runner.cache.k.numel() * runner.cache.k.element_size() * 2
    assert runner.cache.k.dtype == torch.float16
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    assert 0 <= cache - estimate.target_kv < per_token * 64, (cache, estimate.target_kv)  # whole blocks


def test_the_embedded_default_counts_its_file_not_a_float_copy():
    """The default (a ~90 MiB Q4_1 GGUF) was shown as 565 MiB: int4 re-quantisation arithmetic and a bfloat16
    cache... for a model the native path runs as stored."""
    pair = load_pairs()[DEFAULT_PAIR]
    s = pair.target
    if not memory.as_stored(s, CPU):
        pytest.skip("the CPU native model is not available here")
    estimate = memory.estimate_pair(pair, CPU)
    file = packaged_gguf_path()
    assert estimate.target_weights == sum(t.raw.nbytes for t in read_gguf(file).tensors.values())
    assert estimate.target_weights <= file.stat().st_size
    assert estimate.target_kv == s.num_layers * 2 * s.num_kv_heads * s.head_dim * 2 * pair.context_length
    kv_and_file = file.stat().st_size + estimate.target_kv
    assert kv_and_file < estimate.total < kv_and_file + 150 * 2**20, estimate


def test_types_without_a_kernel_count_at_f16():
    spec = load_pairs()[DEFAULT_PAIR].target
    # 10 Q3_K blocks (110 bytes, 256 weights each) become 2,560 F16 weights; Q8_0 stays as stored.
    mixed = dataclasses.replace(spec, weight_types=(("Q3_K", 1100), ("Q8_0", 340)), weight_bytes=1440)
    assert memory.native_weight_bytes(mixed) == 2560 * 2 + 340
    safetensors = dataclasses.replace(spec, weight_types=(("BF16", 1000), ("F32", 40)), weight_bytes=1040)
    assert memory.native_weight_bytes(safetensors) == 1040


def test_paths_that_are_not_native_keep_their_arithmetic(monkeypatch):
    pair = load_pairs()[DEFAULT_PAIR]
    spec = pair.target
    monkeypatch.delenv("SPECCHAT_NATIVE", raising=False)
    if not memory.as_stored(spec, CPU):
        pytest.skip("the CPU native model is not available here")
    assert not memory.as_stored(spec, torch.device("cuda"))
    for changed in (
        dict(quantization="nf4"),  # bitsandbytes
        dict(trust_remote_code=True),
        dict(architecture="gpt2"),  # a family the native model does not run
        dict(kind="local", quantization="int4-torch"),  # a checkpoint re-quantised
    ):
        assert not memory.as_stored(dataclasses.replace(spec, **changed), CPU), changed
    assert memory.as_stored(dataclasses.replace(spec, kind="local", quantization="none"), CPU)
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")
    assert not memory.as_stored(spec, CPU)
    off = memory.estimate_pair(pair, CPU)
    assert off.target_weights == memory._torch_quantized_bytes(spec, CPU)  # int4-torch, as loading does then


@pytest.mark.slow
def test_the_default_on_the_native_path_stays_within_its_estimate(native_ready):  # noqa: F811
    """A fresh process: the engine loads the default (native), answers a ~400-token prompt; its resident growth
    holds at least the file's weights and no more than the estimate (which counts every KV slot of the context,
    though the cache's pages are only touched as tokens arrive)."""
    script = textwrap.dedent("""
        import gc, json, torch
        from specchat.backend.api import GenerationRequest, SamplingParams
        from specchat.backend.engine.engine import load_engine
        from specchat.backend.kernels import native
        from specchat.backend.limits import DEFAULT_PAIR
        from specchat.backend.models.catalog.config import load_pairs
        from specchat.backend.models.facts.memory import estimate_pair
        import specchat.backend.models.loading.pair, specchat.backend.engine.runner  # code, not the model's memory
        def rss():
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
        assert native.ensure() is None
        pair = load_pairs()[DEFAULT_PAIR]
        gc.collect(); before = rss()
        engine = load_engine(pair, device="cpu")
        words = " ".join(f"word{i}" for i in range(200))
        sampling = SamplingParams(temperature=0.0, max_new_tokens=16, seed=0)
        for _ in engine.generate(GenerationRequest(messages=[{"role": "user", "content": words}], sampling=sampling)):
            pass
        gc.collect()
        estimate = estimate_pair(pair, torch.device("cpu"))
        print(json.dumps({"growth": rss() - before, "total": estimate.total, "weights": estimate.target_weights,
                          "path": engine.runner.path}))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=os.environ.copy(), timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["path"] == "cpu-native"
    assert numbers["weights"] <= numbers["growth"] <= numbers["total"], numbers


def test_the_noise_term_follows_the_rows_sampling_draws_at_once():
    from specchat.backend.speculative import sampling

    assert memory.PICK_ROWS == sampling.PICK_ROWS


def test_the_whole_process_counts_the_runtime_and_the_tokenizer():
    """`specchat models` shows the whole process (what benchmarks/memory_vs_llama.py compares with the measured
    peak): the model's terms plus the runtime (Python, torch) and the tokenizer by vocabulary size; CPU only, and
    not in ``total`` (free memory is what is left beside the running process)."""
    pair = load_pairs()[DEFAULT_PAIR]
    estimate = memory.estimate_pair(pair, CPU)
    assert estimate.runtime == memory.RUNTIME_BYTES + pair.target.vocab_size * memory.TOKENIZER_BYTES_PER_TOKEN
    assert estimate.process == estimate.total - estimate.headroom + estimate.runtime  # the margin is not held
    assert "runtime" in estimate.describe(pair.context_length)
    larger = dataclasses.replace(pair.target, vocab_size=4 * pair.target.vocab_size)
    assert memory.runtime_bytes(larger) - memory.runtime_bytes(pair.target) == (
        3 * pair.target.vocab_size * memory.TOKENIZER_BYTES_PER_TOKEN
    )
    assert memory.estimate_pair(pair, torch.device("cuda")).runtime == 0
