"""The C++ decoder layers (backend/kernels/native.py, native_pass.cpp) against the compact forward's Python loop:
the same logits bit for bit, on tiny models of each family and on the embedded default; how a runner attaches
them from the cache, and what happens when the build fails.

The library is built once for this module (~20 s) with the machine's C++ compiler."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
from engine_fixtures import tiny_loaded, tiny_pair
from tiny_models import SMOLLM_ATTENTION, random_ids
from tiny_models import quantised_paged as _quantised
from tiny_models import tiny_paged_cache as _cache

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.engine.runner import forward_paged
from specchat.backend.kernels import compact, native
from specchat.backend.kv import attention
from specchat.backend.models.config import load_pairs
from specchat.backend.models.loading import load_model
from specchat.backend.models.quantized import quantize_model


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if native.compiler() is None:
        pytest.skip("no C++ compiler on this machine (set CXX, or install g++): the native layers cannot be built")
    out = tmp_path_factory.mktemp("native") / "specchat_native.so"
    assert native.build(out) is None
    native.load(out)
    return out


class Counting(native.Native):
    """Counts the passes it ran (to show the comparison really went through C++)."""

    ran = 0

    def layers(self, h, cos, signed_sin, ctx) -> None:
        self.ran += 1
        super().layers(h, cos, signed_sin, ctx)


def _both(model, fast):
    """Two sequences on two caches: one for the Python loop, one with the native layers bound to its cache."""
    python_cache, native_cache = _cache(model), _cache(model)
    bound = Counting(fast, native_cache)
    return python_cache.new_sequence(), native_cache.new_sequence(), bound


def _pass(model, fast, seq, ids, keep, native_layers=None, parents=None):
    fast.native = native_layers
    try:
        return forward_paged(model, seq, ids, logits_to_keep=keep, fast=fast, parents=parents)
    finally:
        fast.native = None


@pytest.mark.parametrize("family", compact.ARCHITECTURES)
def test_native_layers_give_the_python_loops_logits_bit_for_bit(library, family):
    """Prefill (the Python loop's, over the row-wise limit), verification passes of 7 and 64 tokens and one-token
    passes; mistral and qwen2 (qkv bias) cross their sliding window of 8."""
    model = _quantised(family, **SMOLLM_ATTENTION)
    fast = compact.build(model)
    python_seq, native_seq, bound = _both(model, fast)
    steps = [(random_ids(85, seed=4), 1), (random_ids(7, seed=5), 7), *[([t], 1) for t in random_ids(12, seed=6)],
             (random_ids(64, seed=7), 64), *[([t], 1) for t in random_ids(3, seed=8)]]
    for ids, keep in steps:
        expected = _pass(model, fast, python_seq, ids, keep)
        got = _pass(model, fast, native_seq, ids, keep, bound)
        assert torch.equal(got, expected), (family, len(ids), python_seq.length)
        python_seq.commit(len(ids))
        native_seq.commit(len(ids))
    assert bound.ran == len(steps) - 1  # every pass but the 85-token prefill went through C++
    tree, parents = random_ids(6, seed=9), [-1, 0, 0, 1, -1]  # a tree of drafts after the pending token
    assert torch.equal(_pass(model, fast, native_seq, tree, 6, bound, parents),
                       _pass(model, fast, python_seq, tree, 6, None, parents))
    assert bound.ran == len(steps) - (family != "llama")  # a sliding window cuts the tree: the Python loop's
    assert native.differs_from_python(fast, _cache(model)) is None
    bound.release()


def test_passes_it_does_not_take_keep_the_python_loop(library):
    model = _quantised("mistral", **SMOLLM_ATTENTION)
    fast = compact.build(model)
    python_seq, native_seq, bound = _both(model, fast)
    prompt = random_ids(20, seed=1)
    for seq in (python_seq, native_seq):
        _pass(model, fast, seq, prompt, 1, bound if seq is native_seq else None)
        seq.commit(len(prompt))
    ran = bound.ran
    tree, parents = random_ids(4, seed=2), [-1, -1, 1]  # a tree its sliding window (8) cuts: the Python loop's
    assert torch.equal(_pass(model, fast, native_seq, tree, 4, bound, parents),
                       _pass(model, fast, python_seq, tree, 4, None, parents))
    long = random_ids(compact.ROWWISE_ROWS + 1, seed=3)  # more rows than the row-wise attention takes
    assert torch.equal(_pass(model, fast, native_seq, long, 2, bound), _pass(model, fast, python_seq, long, 2))
    other = _cache(model).new_sequence()  # a cache the layers are not bound to
    _pass(model, fast, other, prompt, 1, bound)
    assert bound.ran == ran
    bound.release()
    with pytest.raises(RuntimeError, match="no model"):
        bound.handle = 10**6
        bound.layers(torch.zeros(1, fast.hidden), torch.zeros(1), torch.zeros(1),
                     attention.PagedContext(native_seq.cache, native_seq.plan(1)))


def _int4_engine(drafter: str = "prompt-lookup") -> Engine:
    target = tiny_loaded("llama", **SMOLLM_ATTENTION)
    quantize_model(target.model, "int4-torch", torch.device("cpu"))
    return Engine(target, None, tiny_pair(drafter=drafter))


def _reply(engine: Engine, drafter: str) -> list[int]:
    request = GenerationRequest(prompt_ids=random_ids(40, seed=9) * 2, drafter=drafter,
                                sampling=SamplingParams(temperature=0, max_new_tokens=24))
    return [t for event in engine.generate(request) for t in event.token_ids]


def test_a_runner_attaches_the_cached_library_and_releases_it(library, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(native.SWITCH, "0")
    reference = _int4_engine()
    assert reference.runner.native is None
    expected = _reply(reference, "none")
    monkeypatch.setenv(native.SWITCH, "1")
    native.library_path().parent.mkdir(parents=True)
    shutil.copy(library, native.library_path())
    engine = _int4_engine()
    assert engine.runner.native is not None and engine.runner.native.wait(60), engine.runner.native.reason
    bound = engine.runner.compact.native
    assert _reply(engine, "none") == expected and _reply(engine, "prompt-lookup") == expected
    engine.close()
    assert engine.runner.compact.native is None and bound.handle == -1


def test_a_failed_build_is_noted_and_the_python_loop_stays(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    out = native.library_path()
    assert "failed (exit 1)" in (native.build(out) or "")
    assert not out.exists() and (tmp_path / "native").is_dir()
    assert "an earlier build failed" in (native._build_in_background(out) or "")
    monkeypatch.setenv(native.SWITCH, "1")
    caplog.set_level("INFO", logger=native.__name__)
    engine = _int4_engine()
    assert engine.runner.native is not None and not engine.runner.native.wait(60)
    assert "an earlier build failed" in (engine.runner.native.reason or "")
    assert "decodes through the compact forward's Python loop" in caplog.text
    assert len(_reply(engine, "prompt-lookup")) == 24
    engine.close()


def test_the_embedded_default_gives_the_same_logits_natively(library):
    """24 greedy one-token passes and 24 five-token passes after a 300-token prompt, on the real weights."""
    loaded = load_model(load_pairs()["smollm2-135m"].target, "cpu")
    engine = Engine(loaded, None, load_pairs()["smollm2-135m"])
    runner, fast = engine.runner, engine.runner.compact
    assert fast is not None and native.bindable(fast) is None
    assert native.differs_from_python(fast, runner.cache) is None
    prompt = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    bound = native.Native(fast, runner.cache)
    for rows in (1, 5):
        replies = []
        for layers in (None, bound):
            seq = runner.cache.new_sequence()
            _pass(runner.model, fast, seq, prompt, 1)
            seq.commit(len(prompt))
            token, logits = [prompt[-1]], []
            for step in range(24):
                ids = token if rows == 1 else prompt[step:step + rows]
                logits.append(_pass(runner.model, fast, seq, ids, rows, layers))
                seq.commit(1)
                token = [int(logits[-1][-1].argmax())]
            replies.append(torch.stack(logits))
            seq.free()
        assert torch.equal(replies[0], replies[1]), rows
    bound.release()
    engine.close()


def test_one_build_at_a_time_across_processes(monkeypatch, tmp_path):
    """A second specchat started while the first compiles waits for that build instead of compiling again; a
    lock left by a build that died is taken over."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    out = native.library_path()
    out.parent.mkdir(parents=True)
    lock = out.with_name(out.name + ".building")
    lock.touch()
    assert native.build(out) == native.BUSY and native.main(["build", str(out)]) == native.BUSY_EXIT
    finished = threading.Timer(0.6, lambda: (out.write_bytes(b"built elsewhere"), lock.unlink()))
    finished.start()
    assert native._build_in_background(out, wait_s=30) is None and out.read_bytes() == b"built elsewhere"
    out.unlink()
    lock.touch()
    os.utime(lock, (0, 0))  # a lock as old as the epoch: its build died
    assert "failed (exit 1)" in (native.build(out) or "") and not lock.exists()
