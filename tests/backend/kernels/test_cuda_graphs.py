"""Static-shape forwards (backend/kernels/cuda_graphs.py): on CPU the static mode runs eagerly and must give the normal
paged path's logits on every supported family, with padded token buckets, masked key buckets, fragmented block
tables, rollback and one-row shapes (the lm_head on the last real token only); buckets, buffer reuse (no
reallocation across steps, one logits buffer for every shape) and the fallback rules; a greedy engine run with
graph runners gives the same tokens. The ``cuda`` tests capture and replay real CUDA
graphs (run by packaging/device_check.sh; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import tiny_engine
from paged import paged_forward
from tiny_models import FAMILIES, build_tiny, random_ids

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.forward_paths import GraphPath
from specchat.backend.kernels import cuda_graphs
from specchat.backend.kv.attention import use_paged_attention
from specchat.backend.kv.kv_cache import PagedKVCache

TOL = 1e-4
CONTEXT = 40


def _cache(model, *, fragmented: bool, block_size: int = 4, max_tokens: int = 256, device: str = "cpu") -> PagedKVCache:
    cache = PagedKVCache.for_model(
        model.config, max_tokens=max_tokens, block_size=block_size, dtype=next(model.parameters()).dtype, device=device
    )
    if fragmented:  # every other block held by a dummy sequence: new sequences' blocks are not a run
        holders = [cache.new_sequence() for _ in range(cache.pool.num_blocks // 2)]
        for h in holders:
            h.reserve(block_size * 2)
            h.commit(block_size * 2)
        for h in holders:
            h.truncate(block_size)
    return cache


def _scenario(model, seq, ids: list[int], graphs=None) -> list[torch.Tensor]:
    """Chunked prefill, single-token decode, a verification chunk with rollback (as test_attention)."""
    got = []
    for lo, hi, keep in ((0, 6, 1), (6, 17, 11), (17, 26, 9)):  # 6 -> bucket 8, 11 -> 16, 9 -> 16 (padded)
        got.append(paged_forward(model, seq, ids[lo:hi], logits_to_keep=keep, graphs=graphs))  # keep 1: one row
        seq.commit(hi - lo)
    for t in ids[26:30]:
        got.append(paged_forward(model, seq, [t], graphs=graphs))
        seq.commit(1)
    wrong = [(t + 1) % 100 + 3 for t in ids[34:37]]
    got.append(paged_forward(model, seq, ids[30:34] + wrong, logits_to_keep=7, graphs=graphs)[:4])
    seq.commit(5)
    seq.truncate(34)
    got.append(paged_forward(model, seq, torch.tensor(ids[34:40]), logits_to_keep=3, graphs=graphs))
    seq.commit(6)
    return got


@pytest.mark.parametrize("fragmented", [False, True], ids=["run", "fragmented"])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_mode_matches_eager(family: str, fragmented: bool) -> None:
    model = build_tiny(family)
    use_paged_attention(model)
    ids = random_ids(CONTEXT, seed=11)
    eager = _scenario(model, _cache(model, fragmented=fragmented).new_sequence(), ids)
    cache = _cache(model, fragmented=fragmented)
    runner = cuda_graphs.GraphRunner(model, cache, kv_step=16)  # several key buckets within 40 tokens
    static = _scenario(model, cache.new_sequence(), ids, graphs=runner)
    assert runner.stats["eager_static"] == 9 and runner.stats["fallbacks"] == 0
    # padded rows, masked keys and a one-row shape happen
    assert set(runner._shapes) == {(8, 16, 1), (16, 32, 16), (1, 32, 1), (8, 48, 8)}
    assert runner._logits.shape == (32, model.config.get_text_config().vocab_size)  # one buffer for all shapes
    runner.release()
    for a, b in zip(eager, static):
        torch.testing.assert_close(b, a, atol=TOL, rtol=0)


def test_buckets() -> None:
    model = build_tiny("llama")
    use_paged_attention(model)
    runner = cuda_graphs.GraphRunner(model, _cache(model, fragmented=False, max_tokens=200), kv_step=64)
    assert [runner.token_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 32, 33)] == [1, 2, 4, 8, 8, 16, 16, 32, 32, None]
    assert runner.max_kv == 256  # 200 slots rounded up to the kv step
    assert [runner.kv_bucket(k) for k in (1, 64, 65, 256, 257)] == [64, 64, 128, 256, None]
    custom = cuda_graphs.GraphRunner(model, runner.cache, token_buckets=(3, 1, 11), kv_step=8, max_kv=20)
    assert [custom.token_bucket(n) for n in (1, 2, 3, 4, 11, 12)] == [1, 3, 3, 11, 11, None]
    assert custom.max_kv == 24 and custom.kv_bucket(24) == 24 and custom.kv_bucket(25) is None
    with pytest.raises(ValueError):
        cuda_graphs.GraphRunner(model, runner.cache, token_buckets=(0, 2))


def test_buffers_are_reused_across_steps() -> None:
    model = build_tiny("qwen2")
    use_paged_attention(model)
    cache = _cache(model, fragmented=True)
    runner = cuda_graphs.GraphRunner(model, cache, kv_step=64)
    seq = cache.new_sequence()
    ids = random_ids(30, seed=2)
    paged_forward(model, seq, ids[:5], logits_to_keep=5, graphs=runner)
    seq.commit(5)
    ptrs = (runner._dev.data_ptr(), runner._host.data_ptr())
    logits_ptr = runner._logits.data_ptr()
    shape = runner._shapes[(8, 64, 8)]
    ctx_ptrs = (shape.ctx.positions.data_ptr(), shape.ctx.write_slots.data_ptr(), shape.ctx.read_slots.data_ptr())
    for t in ids[5:25]:
        paged_forward(model, seq, [t], graphs=runner)
        seq.commit(1)
        assert (runner._dev.data_ptr(), runner._host.data_ptr()) == ptrs
    step = runner._shapes[(1, 64, 1)]
    assert set(runner._shapes) == {(8, 64, 8), (1, 64, 1)}  # twenty decode steps, one static shape
    assert runner._logits.data_ptr() == logits_ptr  # every shape writes the same logits rows
    assert (step.ctx.read_slots.data_ptr(), step.ctx.positions.data_ptr()) == (ctx_ptrs[2], ctx_ptrs[0])
    assert step.ctx.write_slots.data_ptr() == ctx_ptrs[1]  # every shape views the same buffers
    runner.release()


def test_fallback_rules_and_trash_block() -> None:
    model = build_tiny("llama")
    use_paged_attention(model)
    cache = _cache(model, fragmented=False, max_tokens=64)
    free_before = cache.pool.num_free
    other = cache.new_sequence()  # another conversation: padded writes must never touch its slots
    other.reserve(8)
    other.commit(8)
    runner = cuda_graphs.GraphRunner(model, cache, kv_step=16, max_kv=32, token_buckets=(1, 2, 4, 8, 16))
    assert cache.pool.num_free == free_before - 3  # two blocks for `other`, one trash block
    snapshot = cache.k[:, :, other.slot(0) : other.slot(7) + 1].clone()
    seq = cache.new_sequence()
    ids = random_ids(40, seed=5)
    paged_forward(model, seq, ids[:20], logits_to_keep=1, graphs=runner)  # 20 > largest bucket: eager
    seq.commit(20)
    assert runner.stats == {"replays": 0, "eager_static": 0, "captures": 0, "fallbacks": 1}
    paged_forward(model, seq, ids[20:23], logits_to_keep=3, graphs=runner)  # bucket 4: one padded token, to trash
    seq.commit(3)
    assert runner.stats["eager_static"] == 1
    paged_forward(model, seq, ids[23:33], logits_to_keep=1, graphs=runner)  # kv 33 > max_kv 32: eager
    assert runner.stats["fallbacks"] == 2
    torch.testing.assert_close(cache.k[:, :, other.slot(0) : other.slot(7) + 1], snapshot, atol=0, rtol=0)
    # A sequence of another cache is not the runner's: eager.
    foreign = _cache(model, fragmented=False).new_sequence()
    paged_forward(model, foreign, ids[:2], logits_to_keep=1, graphs=runner)
    assert runner.stats["fallbacks"] == 3
    runner.disabled_reason = "capture failed (test)"
    seq.truncate(23)
    paged_forward(model, seq, ids[23:24], graphs=runner)
    assert runner.stats["fallbacks"] == 4 and runner.stats["eager_static"] == 1
    runner.release()
    assert runner.disabled_reason == "released"
    assert cache.pool.num_free == free_before - 2 - len(seq.block_table)  # the trash block went back


def test_graphs_wanted_only_on_cuda(monkeypatch) -> None:
    assert not cuda_graphs.graphs_wanted(torch.device("cpu"))
    monkeypatch.setenv("SPECCHAT_CUDA_GRAPHS", "0")
    assert not cuda_graphs.graphs_wanted(torch.device("cuda"))


def _greedy_tokens(engine, prompt: list[int], n: int, **request) -> list[int]:
    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=n), **request)
    return [t for ev in engine.generate(req) for t in ev.token_ids]


@pytest.mark.parametrize("drafter", ["none", "draft-model"])
def test_engine_tokens_identical_with_static_runner(drafter: str) -> None:
    prompt = random_ids(12, seed=4)
    kwargs = dict(
        drafter=drafter,
        draft_family="llama" if drafter == "draft-model" else None,
        draft_seed=1,
        gamma=3 if drafter == "draft-model" else "auto",
    )
    plain = _greedy_tokens(tiny_engine("llama", **kwargs), prompt, 24)
    engine = tiny_engine("llama", **kwargs)
    runners = []
    for model_runner in filter(None, (engine.runner, engine.draft_runner)):  # the engine's runners, graphed
        model_runner.graphs = cuda_graphs.GraphRunner(model_runner.model, model_runner.cache, kv_step=16)
        model_runner.forward_path = GraphPath(model_runner.model, model_runner.graphs)
        runners.append(model_runner.graphs)
    assert _greedy_tokens(engine, prompt, 24) == plain
    assert all(r.stats["eager_static"] > 0 for r in runners)


# -- CUDA: real capture and replay (packaging/device_check.sh runs these) ------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_cuda_replay_matches_eager_logits(family: str) -> None:
    model = build_tiny(family).cuda()
    use_paged_attention(model)
    ids = random_ids(CONTEXT, seed=11)
    eager = _scenario(model, _cache(model, fragmented=True, device="cuda").new_sequence(), ids)
    cache = _cache(model, fragmented=True, device="cuda")
    runner = cuda_graphs.GraphRunner(model, cache, kv_step=16)
    static = _scenario(model, cache.new_sequence(), ids, graphs=runner)
    assert runner.disabled_reason is None, runner.disabled_reason
    assert runner.stats["replays"] == 9 and runner.stats["captures"] == len(runner._shapes)
    for a, b in zip(eager, static):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=0)
    runner.release()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("drafter", ["none", "draft-model"])
def test_cuda_greedy_generation_identical_to_eager(drafter: str, monkeypatch) -> None:
    """The engine attaches runners itself on CUDA; SPECCHAT_CUDA_GRAPHS=0 gives the eager reference."""
    prompt = random_ids(12, seed=4)
    kwargs = dict(
        drafter=drafter,
        draft_family="llama" if drafter == "draft-model" else None,
        draft_seed=1,
        gamma=3 if drafter == "draft-model" else "auto",
    )

    def run(graphs: str) -> tuple[list[int], object]:
        monkeypatch.setenv("SPECCHAT_CUDA_GRAPHS", graphs)
        engine = tiny_engine("llama", **kwargs)
        for loaded in filter(None, (engine.target, engine.draft)):
            loaded.model.cuda()
            loaded.device = torch.device("cuda")
        engine = type(engine)(engine.target, engine.draft, engine.pair)  # rebuilt on CUDA: caches, runners
        return _greedy_tokens(engine, prompt, 48), engine

    eager, eager_engine = run("0")
    assert eager_engine.runner.graphs is None
    graphed, engine = run("1")
    runner = engine.runner.graphs
    assert runner is not None and runner.disabled_reason is None, runner and runner.disabled_reason
    assert runner.stats["replays"] > 0
    assert graphed == eager


@pytest.mark.cuda
@cuda
def test_cuda_plain_step_has_one_host_sync(monkeypatch) -> None:
    """A plain decode step, graphs replayed, synchronises with the GPU once (the token id to the host)."""
    import warnings

    monkeypatch.setenv("SPECCHAT_CUDA_GRAPHS", "1")
    model = build_tiny("llama").cuda()
    use_paged_attention(model)
    cache = _cache(model, fragmented=False, device="cuda")
    runner = cuda_graphs.GraphRunner(model, cache)
    seq = cache.new_sequence()
    token = int(paged_forward(model, seq, random_ids(8), logits_to_keep=1, graphs=runner)[0].argmax())
    seq.commit(8)
    paged_forward(model, seq, [token], graphs=runner)  # capture the one-token shape outside the counted steps
    seq.truncate(8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                token = int(paged_forward(model, seq, [token], graphs=runner)[0].argmax())
                seq.commit(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 4, [str(w.message) for w in syncs]
    runner.release()


def test_static_bytes_no_longer_grow_with_shapes() -> None:
    """What a runner keeps outside its pool is one float32 logits buffer of the largest bucket's rows (plus the
    index buffers), whatever number of (token, key) shapes it captures: for Qwen2.5-7B at an 8k context the
    former per-shape float32 logits were ~1.2 GB, now ~19 MB (backend/models/facts/memory.py counts it)."""
    vocab, context = 152064, 8192
    per_shape_before = sum(nb * vocab * 4 for nb in cuda_graphs.DEFAULT_TOKEN_BUCKETS)
    kv_buckets = context // cuda_graphs.DEFAULT_KV_STEP
    assert per_shape_before * kv_buckets > 1.1e9
    assert cuda_graphs.static_bytes(vocab, context) < 20e6
    model = build_tiny("llama")
    use_paged_attention(model)
    runner = cuda_graphs.GraphRunner(model, _cache(model, fragmented=False), kv_step=16)
    seq = runner.cache.new_sequence()
    for n in (1, 3, 7, 20):
        paged_forward(model, seq, random_ids(n, seed=n), logits_to_keep=n, graphs=runner)
        seq.commit(n)
    assert len(runner._shapes) >= 4
    assert not any(hasattr(shape, "logits") for shape in runner._shapes.values())  # no output per shape
    runner.release()
