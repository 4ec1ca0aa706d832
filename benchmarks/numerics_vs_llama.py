"""Where specchat's native numerics and llama.cpp's part (issue 48 item 2): final-norm states of several "sides" over
the same ids, compared pairwise through one output layer, plus the KV cache types' decoding speed.

A side is ``llama:FILE[:FLAGS]`` (``llama-server --embeddings --pooling none`` with extra FLAGS, e.g. ``-fa off``
or ``-ctk f32 -ctv f32``) or ``specchat:FILE[:CACHE]`` (the native pass over a KV cache of float16, the default
for a GGUF, bfloat16 or float32). Every pair is compared as ``agreement_vs_llama.py`` compares specchat with
llama.cpp: KL(first || second), top-1 agreement, the first side's top-two gap where they differ, the median
relative difference of the states; the logits are the states through the output layer of ``--head`` (default:
the first side's file) in float32. So llama.cpp can be set against itself (flash attention on or off, its cache
types, a Q8_0 file against the F16 one) to show how far two valid computations of the same file part.

    python benchmarks/numerics_vs_llama.py --tokens 4096 llama:F16.gguf llama:Q8_0.gguf specchat:Q8_0.gguf
    python benchmarks/numerics_vs_llama.py --cache-speed --packaged [--context 2048] [--rounds 3] [--caches f16 bf16]

``--cache-speed`` decodes ``--steps`` one-token passes after ``--context`` ids with each cache type in turn
(``--rounds`` interleaved rounds, CPU ms per token of this process, best with ``--threads 1`` on a shared
machine): what the cache's element type costs the attention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from agreement_vs_llama import llama_hidden  # this folder is on sys.path when the script runs

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256
CACHES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def _text() -> str:  # as agreement_vs_llama.py: the repository's documentation
    return "\n\n".join(
        p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )


def _engine(gguf: Path, tokens: int, cache: str = "f16"):
    """The engine on ``gguf`` (native path) with its cache rebound as ``cache``."""
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.kv.kv_cache import PagedKVCache
    from specchat.backend.models.catalog.config import load_pairs

    with tempfile.TemporaryDirectory() as folder:
        pairs = Path(folder) / "models.yaml"
        pairs.write_text(f"pairs:\n  - name: bench\n    target:\n      source: {gguf}\n    drafter: none\n"
                         f"    context_length: {tokens + 64}\n")  # fmt: skip
        engine = load_engine(load_pairs(pairs)["bench"], device="cpu")
    native = engine.runner.native
    if native is None:
        raise SystemExit(f"the native model does not run {gguf}: {engine.start_line}")
    if engine.runner.cache.k.dtype != CACHES[cache]:
        engine.runner.cache = PagedKVCache.for_model(
            engine.target.model.config, max_tokens=tokens + 64, dtype=CACHES[cache], device="cpu"
        )
        native.bind(engine.runner.cache)
    return engine


def _specchat(gguf: Path, cache: str, ids: list[int]) -> torch.Tensor:
    engine = _engine(gguf, len(ids), cache)
    native = engine.runner.native
    seq = engine.runner.cache.new_sequence()
    hidden = []
    for start in range(0, len(ids), CHUNK):
        part = torch.tensor(ids[start : start + CHUNK], dtype=torch.long)
        _, taps = native.forward(seq, part, 1, None, [native.arch.layers])
        seq.commit(part.numel())
        hidden.append(taps[0])
    seq.free()
    return torch.cat(hidden)


def _logprobs(engine, hidden: torch.Tensor) -> torch.Tensor:
    native = engine.runner.native
    weight = native.head_weight if native.head_weight is not None else native.embed_weight
    out = []
    for start in range(0, hidden.shape[0], CHUNK):
        logits = weight.matmul(hidden[start : start + CHUNK].contiguous())
        cap = float(native.arch.final_softcap)
        out.append(torch.log_softmax(torch.tanh(logits / cap) * cap if cap else logits, dim=-1))
    return torch.cat(out)


def _compare(engine, first: torch.Tensor, second: torch.Tensor) -> dict[str, object]:
    a, b = _logprobs(engine, first), _logprobs(engine, second)
    kl = (a.exp() * (a - b)).sum(-1).clamp_min(0)
    agree = a.argmax(-1) == b.argmax(-1)
    top2 = a.exp().topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1])[~agree]
    relative = ((first - second).norm(dim=-1) / first.norm(dim=-1)).median()
    return {
        "mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "top1_agreement": float(agree.float().mean()),
        "disagreements": int((~agree).sum()), "disagreement_gaps_max": float(gaps.max()) if gaps.numel() else None,
        "median_relative_hidden_difference": float(relative),
    }  # fmt: skip


def _cache_speed(gguf: Path, ids: list[int], caches: list[str], steps: int, rounds: int) -> dict[str, list[float]]:
    """ms per one-token pass after ``ids``, per cache type and round; rounds interleaved, the order rotating."""
    engines = {name: _engine(gguf, len(ids) + steps, name) for name in caches}
    times: dict[str, list[float]] = {name: [] for name in caches}
    for turn in range(rounds):
        for name in caches[turn % len(caches) :] + caches[: turn % len(caches)]:
            engine = engines[name]
            native, seq = engine.runner.native, engine.runner.cache.new_sequence()
            for start in range(0, len(ids), CHUNK):
                part = torch.tensor(ids[start : start + CHUNK], dtype=torch.long)
                native.forward(seq, part, 1)
                seq.commit(part.numel())
            token = torch.tensor(ids[-1:], dtype=torch.long)
            began = time.process_time()  # this process's CPU time: other processes' load counts less than in wall time
            for _ in range(steps):
                native.forward(seq, token, 1)
                seq.commit(1)
            times[name].append((time.process_time() - began) * 1000 / steps)
            seq.free()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sides", nargs="*", help="llama:FILE[:FLAGS] or specchat:FILE[:f16|bf16|f32]")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--head", type=Path, help="the GGUF whose output layer turns states into logits")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8977)
    parser.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/llama.cpp-bin/src/build/bin")
    parser.add_argument("--cache-speed", action="store_true")
    parser.add_argument("--packaged", action="store_true", help="--cache-speed on the embedded default")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--caches", nargs="+", choices=sorted(CACHES), default=["f16", "bf16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cache_speed:
        from specchat.backend.models.loading.loaded import packaged_gguf_path

        gguf = packaged_gguf_path() if args.packaged else Path(args.sides[0].split(":")[1])
        ids = _engine(gguf, 64).tokenizer.encode(_text(), add_special_tokens=False)[: args.context]
        times = _cache_speed(gguf, ids, args.caches, args.steps, args.rounds)
        first = times[args.caches[0]]
        print(json.dumps({
            "file": gguf.name, "context": len(ids), "ms_per_token": times,
            "median_ms": {name: statistics.median(values) for name, values in times.items()},
            f"median_ratio_to_{args.caches[0]}": {
                name: statistics.median(v / f for v, f in zip(values, first)) for name, values in times.items()},
        }))  # fmt: skip
        return 0
    if len(args.sides) < 2:
        parser.error("give at least two sides")
    parsed = []
    for side in args.sides:
        kind, _, rest = side.partition(":")
        file, _, option = rest.partition(":")
        if kind not in ("llama", "specchat") or not Path(file).is_file():
            parser.error(f"side {side!r}: llama:FILE[:FLAGS] or specchat:FILE[:CACHE] with an existing FILE")
        if kind == "specchat" and (option or "f16") not in CACHES:
            parser.error(f"side {side!r}: the cache is one of {', '.join(CACHES)}")
        parsed.append((kind, Path(file), option))
    head_engine = _engine(args.head or parsed[0][1], args.tokens)
    ids = head_engine.tokenizer.encode(_text(), add_special_tokens=False)[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    states = []
    for kind, file, option in parsed:
        if kind == "llama":
            states.append(llama_hidden(args.llama_bin, file, ids, torch.get_num_threads(), args.port, option.split()))
        else:
            states.append(_specchat(file, option or "f16", ids))
        print(f"# {kind}:{file.name}:{option} done", file=sys.stderr, flush=True)
    for i in range(len(states)):
        for j in range(i + 1, len(states)):
            row = {"first": args.sides[i], "second": args.sides[j], "positions": len(ids)}
            print(json.dumps(row | _compare(head_engine, states[i], states[j])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
