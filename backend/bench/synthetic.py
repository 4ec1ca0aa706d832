"""`specchat bench --synthetic NAME`: random-weight models with real shapes, built on the device, timed honestly.

Contract: :func:`run_synthetic(args) -> int` builds the pair ``SYNTHETIC[args.synthetic]`` (no download:
config in code, bf16 on CUDA / float32 on CPU, initialisation skipped then a cheap random fill), measures
everything in one process and prints a table; the JSON (every value measured in this run, see
:func:`measure`) goes to ``<out>/synthetic_<name>.json``. Measurements:

- ``read_bandwidth_GBps``: a read-only reduction (``x.sum()`` over a tensor far larger than the caches,
  CUDA events), NOT a copy, which would count reads and writes;
- plain decoding tok/s of specchat's engine (CUDA graphs on CUDA) and of transformers ``generate()`` (SDPA,
  its default cache), same prompt, ``min_new_tokens`` so nothing stops early; both as decode-only rates
  ``(N - 1) / (T(N) - T(1))`` so prefill is not counted;
- the fraction of the bandwidth bound: bytes read per token (weights the step reads, the input embedding
  excluded, plus the mean K/V read) / bandwidth, divided by the measured time per token;
- target step time for 1..16 tokens, draft one-token step time (specchat's paged forward, graphs on CUDA);
- transformers ``generate(assistant_model=draft)``: time per target forward (counted by a hook);
- the expected speedup at α = 0.6 / 0.8 / 0.9 from those times (the policy's formula), best γ per α:
  ``E[N] = (1 - α^(γ+1)) / (1 - α)``, ``S(γ) = E[N]·T_t(1) / (γ·T_d + T_t(γ+1))``.

Random weights make draft and target disagree, so acceptance is not measured here; α is an input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch

from specchat.backend.bench.synthetic_models import (
    SYNTHETIC,
    SyntheticPair,
    build_loaded,
    synthetic_bytes,
    weight_bytes_per_step,
)
from specchat.backend.errors import ConfigError, InsufficientMemoryError
from specchat.backend.speculative.stats import expected_tokens_table, speedup

ALPHAS = (0.6, 0.8, 0.9)
MAX_STEP_TOKENS = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up), each ending in a device sync."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a read-only reduction over ``nbytes`` (CUDA events on GPU, wall clock on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU sums fp32 at full speed
    x = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
    x.sum()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            x.sum()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        seconds = statistics.median(times)
    else:
        seconds = _timed(x.sum, device, 5)
    return x.numel() * x.element_size() / seconds


def expected_speedups(target_s: dict[int, float], draft_s: float, alphas=ALPHAS) -> dict[str, dict]:
    """Best γ and S(γ) per α, from measured target times T_t(n) (n = 1..) and the draft step time."""
    out = {}
    for alpha in alphas:
        best = (0, 0.0)
        table = expected_tokens_table([alpha] * max(target_s))  # a constant α: the geometric E[N]
        for gamma in range(1, max(target_s)):
            s = speedup(table[gamma], gamma, t1=target_s[1], draft_s_per_token=draft_s, target_s=target_s[gamma + 1])
            if s > best[1]:
                best = (gamma, s)
        out[str(alpha)] = {"gamma": best[0], "speedup": best[1]}
    return out


def _engine_decode_rate(engine, prompt: list[int], new_tokens: int) -> float:
    """specchat plain decoding, decode-only tokens/s: (N-1) tokens over the time after the prefill event."""
    from specchat.backend.api import GenerationRequest, SamplingParams

    req = GenerationRequest(
        prompt_ids=prompt, drafter="none", sampling=SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    )
    stamps, count = [], 0
    for event in engine.generate(req):
        count += len(event.token_ids)
        stamps.append(time.perf_counter())  # a step's token ids are on the host when its event is yielded
    if count != new_tokens:
        raise RuntimeError(f"synthetic bench: specchat produced {count} tokens, expected {new_tokens}")
    return (new_tokens - 1) / (stamps[-1] - stamps[0])


def _hf_generate_s(model, prompt: torch.Tensor, new_tokens: int, **extra) -> float:
    t0 = time.perf_counter()
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **extra,
    )
    _sync(prompt.device)
    if out.shape[1] - prompt.shape[1] != new_tokens:
        raise RuntimeError(f"synthetic bench: generate() made {out.shape[1] - prompt.shape[1]} tokens")
    return time.perf_counter() - t0


def _step_times(runner, prompt: list[int], sizes, repeats: int) -> dict[int, float]:
    """Seconds of one paged forward (the model runner's path) over n tokens after a committed prompt (nothing
    committed), per n."""
    cache = runner.cache
    seq = cache.new_sequence()
    runner.forward(seq, prompt, logits_to_keep=1)
    seq.commit(len(prompt))
    out = {
        n: _timed(lambda n=n: runner.forward(seq, prompt[:n], logits_to_keep=n), cache.device, repeats) for n in sizes
    }
    seq.free()
    return out


def measure(
    pair: SyntheticPair, device: torch.device, *, new_tokens: int | None = None, seed: int = 0, progress=print
) -> dict:
    """Build ``pair`` on ``device`` and measure everything the module docstring lists; returns the JSON dict."""
    import transformers

    from specchat.backend.engine.engine import Engine
    from specchat.backend.kv.attention import ATTN_IMPLEMENTATION
    from specchat.backend.kv.kv_cache import kv_bytes_per_token

    n_new = new_tokens or pair.new_tokens
    torch.manual_seed(seed)
    notes: list[str] = []
    progress(f"building {pair.name} target ({pair.target['model_type']}) on {device} ...")
    target, base_pair = build_loaded(pair.target, device, seed=seed, quantization="none")
    progress(f"building draft ({pair.draft_quantization}) ...")
    draft, _ = build_loaded(pair.draft, device, seed=seed + 1, quantization=pair.draft_quantization, notes=notes)
    context = pair.prompt_tokens + n_new + MAX_STEP_TOKENS + 16
    pair_cfg = dataclasses.replace(
        base_pair, name=f"synthetic-{pair.name}", drafter="draft-model", gamma=4, context_length=context, sampling={}
    )
    prompt = torch.randint(
        3, pair.target["vocab_size"], (pair.prompt_tokens,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    bandwidth = read_bandwidth(device, pair.bandwidth_bytes)
    progress(f"read bandwidth {bandwidth / 1e9:.0f} GB/s; specchat plain decoding ...")

    engine = Engine(target, draft, pair_cfg)
    _engine_decode_rate(engine, prompt, n_new)  # warm-up: captures every graph shape the timed run uses
    specchat_tok_s = _engine_decode_rate(engine, prompt, n_new)
    runner = engine.runner.graphs
    graphs = runner is not None and runner.disabled_reason is None and runner.stats["replays"] > 0
    if device.type == "cuda" and not graphs:
        notes.append(f"CUDA graphs not used: {runner.disabled_reason if runner else 'no runner attached'}")
    progress("step times ...")
    target_s = _step_times(engine.runner, prompt, range(1, MAX_STEP_TOKENS + 1), pair.repeats)
    draft_s = _step_times(engine.draft_runner, prompt, [1], pair.repeats)[1]
    engine.close()

    progress("transformers generate() ...")
    for m in (target.model, draft.model):
        m.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt], device=device)
    _hf_generate_s(target.model, ids, 2)  # warm-up
    hf_rate = (n_new - 1) / (_hf_generate_s(target.model, ids, n_new) - _hf_generate_s(target.model, ids, 1))
    calls = [0]
    hook = target.model.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        _hf_generate_s(target.model, ids, 4, assistant_model=draft.model)  # warm-up
        calls[0] = 0
        assisted_s = _hf_generate_s(target.model, ids, n_new, assistant_model=draft.model)
    finally:
        hook.remove()
    for m in (target.model, draft.model):
        m.set_attn_implementation(ATTN_IMPLEMENTATION)

    weights = weight_bytes_per_step(target.model)
    kv_token = kv_bytes_per_token(target.model.config, target.dtype)
    step_bytes = weights + kv_token * (pair.prompt_tokens + n_new / 2)  # mean context read per token
    bound_tok_s = bandwidth / step_bytes
    result = {
        "name": pair.name,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(target.dtype).removeprefix("torch."),
        "draft_quantization": draft.spec.quantization,
        "cuda_graphs": graphs,
        "notes": notes,
        "target_params": sum(p.numel() for p in target.model.parameters()),
        "draft_params": sum(p.numel() for p in draft.model.parameters()),
        "prompt_tokens": pair.prompt_tokens,
        "new_tokens": n_new,
        "target_weight_bytes_per_step": weights,
        "kv_bytes_per_token": kv_token,
        "read_bandwidth_GBps": bandwidth / 1e9,
        "bandwidth_bound_tok_s": bound_tok_s,
        "specchat_plain_tok_s": specchat_tok_s,
        "hf_plain_tok_s": hf_rate,
        "specchat_vs_hf_plain": specchat_tok_s / hf_rate,
        "specchat_fraction_of_bound": specchat_tok_s / bound_tok_s,
        "hf_fraction_of_bound": hf_rate / bound_tok_s,
        "target_step_ms": {str(n): s * 1e3 for n, s in target_s.items()},
        "verify8_over_step1": target_s[8] / target_s[1],
        "draft_step_ms": draft_s * 1e3,
        "hf_assisted_target_forwards": calls[0],
        "hf_assisted_step_ms": assisted_s / max(calls[0], 1) * 1e3,
        "hf_assisted_tok_s": n_new / assisted_s,
        "expected_speedup": expected_speedups(target_s, draft_s),
    }
    return result


def format_table(r: dict) -> str:
    lines = [
        f"synthetic bench {r['name']} on {r['gpu']} ({r['dtype']}, draft {r['draft_quantization']}, "
        f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}; torch {r['torch']}, transformers "
        f"{r['transformers']})",
        f"  prompt {r['prompt_tokens']} tokens, {r['new_tokens']} new; target {r['target_params'] / 1e9:.2f}B "
        f"params, draft {r['draft_params'] / 1e9:.2f}B",
        f"  read bandwidth (x.sum)       {r['read_bandwidth_GBps']:10.1f} GB/s",
        f"  bandwidth bound              {r['bandwidth_bound_tok_s']:10.1f} tok/s",
        f"  specchat plain decode        {r['specchat_plain_tok_s']:10.1f} tok/s  "
        f"({r['specchat_fraction_of_bound']:.0%} of bound, {r['specchat_vs_hf_plain']:.2f}x transformers)",
        f"  transformers generate()      {r['hf_plain_tok_s']:10.1f} tok/s  ({r['hf_fraction_of_bound']:.0%} of bound)",
        f"  transformers assisted        {r['hf_assisted_step_ms']:10.2f} ms/target step "
        f"({r['hf_assisted_target_forwards']} steps, {r['hf_assisted_tok_s']:.1f} tok/s)",
        f"  draft step (1 token)         {r['draft_step_ms']:10.2f} ms",
        "  target step ms by tokens:    " + "  ".join(f"{n}:{ms:.2f}" for n, ms in r["target_step_ms"].items()),
        f"  8-token step / 1-token step  {r['verify8_over_step1']:10.2f}x",
        "  expected speedup (best γ):   "
        + "  ".join(f"α={a}: {v['speedup']:.2f}x @γ={v['gamma']}" for a, v in r["expected_speedup"].items()),
    ]
    lines += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def check_synthetic_fits(pair: SyntheticPair, device: torch.device) -> None:
    """InsufficientMemoryError naming the need and the free memory, before anything is allocated (an 8B model in
    float32 on a laptop's CPU would otherwise die in the allocator)."""
    from specchat.backend.models.facts.memory import format_bytes, free_memory

    need, free = synthetic_bytes(pair, device), free_memory(device)
    if need > free:
        hint = (
            "run it on a CUDA GPU (--device cuda), or use --synthetic tiny on CPU"
            if device.type == "cpu"
            else "free memory on the device or use a larger GPU"
        )
        raise InsufficientMemoryError(
            f"bench --synthetic {pair.name} needs about {format_bytes(need)} on {device} "
            f"but only {format_bytes(free)} is free; {hint}"
        )


def run_synthetic(args) -> int:
    """The ``specchat bench --synthetic NAME`` command body."""
    from specchat.backend.models.loading.pair import resolve_device

    name = args.synthetic
    if name not in SYNTHETIC:
        raise ConfigError(f"bench --synthetic {name!r}: unknown name; known: {', '.join(SYNTHETIC)}")
    device = resolve_device(getattr(args, "device", None))
    check_synthetic_fits(SYNTHETIC[name], device)
    result = measure(
        SYNTHETIC[name],
        device,
        new_tokens=getattr(args, "max_new_tokens", None),
        seed=args.seed,  # checked by app/cli/bench.py
        progress=lambda m: print(m, flush=True),
    )
    print(format_table(result))
    out_dir = Path(getattr(args, "out", None) or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"synthetic_{name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0 if all(math.isfinite(v) for v in _numbers(result)) else 1


def _numbers(obj):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
