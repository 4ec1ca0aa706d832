"""The C++ decoder layers (backend/kernels/native.py, native_build.py, native_pass.cpp, native_attention.h): a
pass's rows equal one-token passes bit for bit (chains and trees of drafts, both attention versions, any thread
count), and the logits stay within rounding of the compact forward's Python loop, on tiny models of each
family and on the embedded default; how a runner attaches them from the cache (between requests), and what
happens when the build fails.

The library is built once for this module (~20 s) with the machine's C++ compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
from specchat.backend.kernels import compact, native, native_build
from specchat.backend.kv import attention
from specchat.backend.models.config import load_pairs
from specchat.backend.models.loading import load_model
from specchat.backend.models.quantized import quantize_model


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler on this machine (set CXX, or install g++): the native layers cannot be built")
    out = tmp_path_factory.mktemp("native") / "specchat_native.so"
    assert native_build.build(out) is None
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


def _close(got, expected) -> bool:
    """Within the native layers' tolerance of the Python loop's logits (native.TOLERANCE)."""
    return float((got - expected).abs().max()) <= native.TOLERANCE * float(expected.std())


def _one_by_one(model, fast, seq, ids, bound):
    """The logits of one-token passes over ``ids``, each committed after it, then rolled back (run it before a
    pass that is then committed: the rollback gives back the blocks past the old length)."""
    rows = []
    for token in ids:
        rows.append(_pass(model, fast, seq, [token], 1, bound))
        seq.commit(1)
    seq.truncate(seq.length - len(ids))
    return torch.cat(rows)


@pytest.mark.parametrize("scalar", [False, True], ids=["avx2", "scalar"])
@pytest.mark.parametrize("family", compact.ARCHITECTURES)
def test_native_rows_equal_one_token_passes_and_the_python_loop_to_rounding(library, family, scalar):
    """Prefill (the Python loop's, over the row-wise limit), then verification passes of 7 and 64 tokens: each
    row equals a one-token pass at its position bit for bit, and the Python loop's logits to rounding; mistral and
    qwen2 (qkv bias) cross their sliding window of 8. A tree's nodes equal plain decoding along their paths."""
    model = _quantised(family, **SMOLLM_ATTENTION)
    fast = compact.build(model)
    python_seq, native_seq = _cache(model).new_sequence(), _cache(model).new_sequence()
    bound = Counting(fast, native_seq.cache, scalar=scalar)
    steps = [random_ids(85, seed=4), random_ids(7, seed=5), random_ids(12, seed=6), random_ids(64, seed=7)]
    for number, ids in enumerate(steps):
        ones = _one_by_one(model, fast, native_seq, ids, bound) if number else None  # not for the prefill
        expected = _pass(model, fast, python_seq, ids, len(ids))
        got = _pass(model, fast, native_seq, ids, len(ids), bound)
        assert _close(got, expected), (family, len(ids), float((got - expected).abs().max()))
        if ones is not None:  # one-token passes give the same rows exactly
            assert torch.equal(got, ones), (family, len(ids))
        python_seq.commit(len(ids))
        native_seq.commit(len(ids))
    tree, parents = random_ids(6, seed=9), [-1, 0, 0, 1, -1]  # a tree of drafts after the pending token
    ran = bound.ran
    logits = _pass(model, fast, native_seq, tree, 6, bound, parents)
    took = family == "llama"  # a sliding window cuts the tree: the Python loop's, compared with its own chains
    assert bound.ran == ran + took
    # Row i's path from the pending token (row 0): draft d is row d + 1, parents[d] its parent draft (-1: none).
    for path in ([0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [0, 5]):
        chain = _one_by_one(model, fast, native_seq, [tree[i] for i in path], bound if took else None)
        assert torch.equal(logits[path[-1]], chain[-1]), (family, path)
    bound.release()


def test_native_rows_do_not_depend_on_the_thread_count(library):
    """The engine gives the compute threads back while other programs are busy (backend/engine/threads.py), so a
    reply's passes run on one thread or two: the same logits either way."""
    model = _quantised("llama", **SMOLLM_ATTENTION)
    fast = compact.build(model)
    seq = _cache(model).new_sequence()
    bound = native.Native(fast, seq.cache)
    _pass(model, fast, seq, random_ids(40, seed=1), 1)
    seq.commit(40)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_pass(model, fast, seq, random_ids(9, seed=2), 9, bound))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    assert native.check(fast, _cache(model)) is None
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
    assert torch.equal(
        _pass(model, fast, native_seq, tree, 4, bound, parents), _pass(model, fast, python_seq, tree, 4, None, parents)
    )
    long = random_ids(compact.ROWWISE_ROWS + 1, seed=3)  # more rows than the row-wise attention takes
    assert torch.equal(_pass(model, fast, native_seq, long, 2, bound), _pass(model, fast, python_seq, long, 2))
    other = _cache(model).new_sequence()  # a cache the layers are not bound to
    _pass(model, fast, other, prompt, 1, bound)
    assert bound.ran == ran
    bound.release()
    with pytest.raises(RuntimeError, match="no model"):
        bound.handle = 10**6
        bound.layers(
            torch.zeros(1, fast.hidden),
            torch.zeros(1),
            torch.zeros(1),
            attention.PagedContext(native_seq.cache, native_seq.plan(1)),
        )


def _int4_engine(drafter: str = "prompt-lookup") -> Engine:
    target = tiny_loaded("llama", **SMOLLM_ATTENTION)
    quantize_model(target.model, "int4-torch", torch.device("cpu"))
    return Engine(target, None, tiny_pair(drafter=drafter))


def _events(engine: Engine, prompt: list[int], drafter: str, conversation: str | None = None):
    request = GenerationRequest(
        prompt_ids=prompt,
        drafter=drafter,
        conversation=conversation,
        sampling=SamplingParams(temperature=0, max_new_tokens=24),
    )
    return list(engine.generate(request))


def _reply(engine: Engine, drafter: str) -> list[int]:
    return [t for event in _events(engine, random_ids(40, seed=9) * 2, drafter) for t in event.token_ids]


def test_a_runner_attaches_the_cached_library_between_requests_and_releases_it(library, monkeypatch, tmp_path):
    """Attached in the background, the layers take over at the next request, never inside a reply: the
    conversations cached until then (K/V from the Python loop) are dropped and prefilled again. Replies through
    them are the same for every drafter."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(native.SWITCH, "0")
    engine = _int4_engine()
    assert engine.runner.native is None
    prompt = random_ids(40, seed=9) * 2
    before = _events(engine, prompt, "none", conversation="chat")
    monkeypatch.setenv(native.SWITCH, "1")
    native_build.library_path().parent.mkdir(parents=True)
    shutil.copy(library, native_build.library_path())
    engine.runner.native = native.attach(engine.runner.compact, engine.cache, "tiny")
    assert engine.runner.native is not None and engine.runner.native.wait(60), engine.runner.native.reason
    assert engine.runner.compact.native is None  # ready, waiting for the next request
    reply = [t for e in before for t in e.token_ids]
    again = _events(engine, prompt + reply + [5, 6], "none", conversation="chat")
    bound = engine.runner.compact.native
    assert bound is not None
    assert again[0].prefill_tokens == len(prompt + reply) + 2  # the whole conversation again, not its new tail
    expected = _reply(engine, "none")
    assert _reply(engine, "prompt-lookup") == expected and _reply(engine, "suffix") == expected
    engine.close()
    assert engine.runner.compact.native is None and bound.handle == -1


def test_a_failed_build_is_noted_and_the_python_loop_stays(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    out = native_build.library_path()
    assert "failed (exit 1)" in (native_build.build(out) or "")
    assert not out.exists() and (tmp_path / "native").is_dir()
    assert "an earlier build failed" in (native_build.build_in_background(out) or "")
    monkeypatch.setenv(native.SWITCH, "1")
    caplog.set_level("INFO", logger=native.__name__)
    engine = _int4_engine()
    assert engine.runner.native is not None and not engine.runner.native.wait(60)
    assert "an earlier build failed" in (engine.runner.native.reason or "")
    assert "decodes through the compact forward's Python loop" in caplog.text
    assert len(_reply(engine, "prompt-lookup")) == 24
    engine.close()


def test_the_embedded_default_natively(library):
    """On the real weights after a 300-token prompt: 24 five-token passes (teacher-forced) whose rows equal
    one-token passes bit for bit and the Python loop's logits to rounding, with the same greedy tokens."""
    loaded = load_model(load_pairs()["smollm2-135m"].target, "cpu")
    engine = Engine(loaded, None, load_pairs()["smollm2-135m"])
    runner, fast = engine.runner, engine.runner.compact
    assert fast is not None and native.bindable(fast) is None
    assert native.check(fast, runner.cache) is None
    prompt = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    bound = native.Native(fast, runner.cache)
    seqs = []
    for _ in range(2):
        seqs.append(runner.cache.new_sequence())
        _pass(runner.model, fast, seqs[-1], prompt, 1)
        seqs[-1].commit(len(prompt))
    python_seq, native_seq = seqs
    same = 0
    for step in range(24):
        ids = prompt[step * 5 : step * 5 + 5]
        ones = _one_by_one(runner.model, fast, native_seq, ids, bound)
        got = _pass(runner.model, fast, native_seq, ids, 5, bound)
        expected = _pass(runner.model, fast, python_seq, ids, 5)
        assert torch.equal(got, ones), step
        assert _close(got, expected), (step, float((got - expected).abs().max()))
        same += int((got.argmax(-1) == expected.argmax(-1)).sum())
        for seq in seqs:
            seq.commit(1)
    assert same >= 0.95 * 24 * 5
    bound.release()
    engine.close()


def test_one_build_at_a_time_across_processes(monkeypatch, tmp_path):
    """A second specchat started while the first compiles waits for that build instead of compiling again; a
    lock left by a build that died is taken over."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    out = native_build.library_path()
    out.parent.mkdir(parents=True)
    lock = out.with_name(out.name + ".building")
    lock.touch()
    assert native_build.build(out) == native_build.BUSY
    assert native_build.main(["build", str(out)]) == native_build.BUSY_EXIT
    finished = threading.Timer(0.6, lambda: (out.write_bytes(b"built elsewhere"), lock.unlink()))
    finished.start()
    assert native_build.build_in_background(out, wait_s=30) is None and out.read_bytes() == b"built elsewhere"
    out.unlink()
    lock.touch()
    os.utime(lock, (0, 0))  # a lock as old as the epoch: its build died
    assert "failed (exit 1)" in (native_build.build(out) or "") and not lock.exists()


EXIT_DURING_CHECK = """
import os, shutil, sys, time
from specchat.backend.kernels import native_build
path = native_build.library_path()
path.parent.mkdir(parents=True, exist_ok=True)
shutil.copy(sys.argv[1], path)
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.config import load_pairs
engine = load_engine(load_pairs()["smollm2-135m"])
attachment = engine.runner.native
while not attachment._checking.is_set() and attachment._thread.is_alive():
    time.sleep(0.001)
print("exiting while checking:", attachment._checking.is_set(), flush=True)
"""


def test_exiting_while_the_attach_checks_does_not_abort(library, tmp_path):
    """A process that ends while the attach thread is inside torch (its check, ~0.3 s after a load: a quick
    `specchat generate --help`-like exit, a UI quit at once) must not die in torch's thread pool teardown
    ("terminate called without an active exception", before an exit hook closed the attachments)."""
    env = {**os.environ, "SPECCHAT_CACHE_DIR": str(tmp_path), native.SWITCH: "1"}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_CHECK, str(library)], env=env, capture_output=True, text=True, timeout=300
    )
    assert "exiting while checking: True" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
