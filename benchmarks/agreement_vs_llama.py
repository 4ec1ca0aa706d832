"""specchat's next-token distributions against llama.cpp's on the same GGUF file and the same token sequence
(issue 48 item 2): per position the KL divergence, whether the top-1 token agrees, and where it does not the gap
between llama.cpp's top two probabilities.

How llama.cpp's side is read: ``llama-server --embeddings --pooling none`` returns, for every position of the
sequence, the final norm's output (the hidden state its output layer reads; ``embd_normalize: -1`` keeps it
unscaled). Its logits here are that hidden state through specchat's own output layer (the file's blocks, the
same kernels, the final soft-cap where the model has one). So the comparison measures every part of the pass
before the output layer (embedding, norms, rotary, attention with its windows, MLPs); the output layer's own
rounding is left out. specchat's side is the native model's pass over the same ids, prefilled in chunks, with
its final-norm tap and logits.

The text is this repository's documentation (README.md, docs/*.md: real English with code), tokenised by
specchat's tokenizer and cut to ``--tokens``; llama-server is given the same ids.

    python benchmarks/agreement_vs_llama.py --packaged [--tokens 4096]
    python benchmarks/agreement_vs_llama.py --gguf FILE
    python benchmarks/agreement_vs_llama.py --gguf FILE-Q8_0 --against FILE-F16   # llama.cpp against itself

Besides KL and agreement it reports the fraction of all positions whose top-two gap is under 0.1 and the mean
top-1 probability, so a reader can judge how many positions were near ties to begin with.

llama.cpp binaries: ``--llama-bin`` (default ~/.cache/llama.cpp-bin/src/build/bin; LD_LIBRARY_PATH is set to it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path

import torch

from specchat.backend.bench.llama_server import LlamaServer

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256


def _text() -> str:
    return "\n\n".join(
        p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )


def llama_hidden(bin_dir: Path, gguf: Path, ids: list[int], threads: int, port: int, flags: list[str]) -> torch.Tensor:
    """[n, hidden] float32: llama.cpp's final-norm output at every position of ``ids`` (llama-server started with
    ``flags`` besides the embedding ones; benchmarks/numerics_vs_llama.py passes its own)."""
    n = len(ids)
    extra = ["-b", str(n + 16), "-ub", str(n + 16), "--embeddings", "--pooling", "none", *flags]
    server = LlamaServer(bin_dir / "llama-server", gguf, spec_type=None, threads=threads, context_length=n + 16,
                         startup_s=300, port=port, extra=extra)  # fmt: skip
    try:
        body = json.dumps({"content": ids, "embd_normalize": -1}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/embedding", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=1800) as answer:
            reply = json.loads(answer.read())
    finally:
        server.close()
    rows = reply[0]["embedding"] if isinstance(reply, list) else reply["embedding"]
    return torch.tensor(rows, dtype=torch.float32)


def _specchat(engine, ids: list[int]):
    """(final-norm states [CHUNK, hidden], log-probabilities [CHUNK, vocab]) of specchat's native pass over
    ``ids``, chunk by chunk (a 262k vocabulary's log-probabilities of 4,096 rows would be 4 GiB)."""
    native = engine.runner.native
    layers = native.arch.layers
    seq = engine.runner.cache.new_sequence()
    try:
        for start in range(0, len(ids), CHUNK):
            part = torch.tensor(ids[start : start + CHUNK], dtype=torch.long)
            logits, taps = native.forward(seq, part, part.numel(), None, [layers])
            seq.commit(part.numel())
            yield taps[0], torch.log_softmax(logits.float(), dim=-1)
    finally:
        seq.free()


def _head(engine, hidden: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``hidden`` [n, hidden] through specchat's output layer (and final soft-cap)."""
    native = engine.runner.native
    weight = native.head_weight if native.head_weight is not None else native.embed_weight
    logits = weight.matmul(hidden.contiguous())
    cap = float(native.arch.final_softcap)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits, dim=-1)


def _compare(reference: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position of one chunk: KL(reference || other), top-1 agreement, the reference's top-two gap and
    top-1 probability."""
    probs = reference.exp()
    top2 = probs.topk(2, dim=-1).values
    return {
        "kl": (probs * (reference - other)).sum(-1).clamp_min(0),
        "agree": reference.argmax(-1) == other.argmax(-1),
        "gap": top2[:, 0] - top2[:, 1],
        "top1": top2[:, 0],
    }


def _report(rows: dict[str, torch.Tensor]) -> dict[str, object]:
    kl, agree, gap = rows["kl"], rows["agree"], rows["gap"]
    n = kl.numel()
    gaps = gap[~agree]
    return {
        "positions": n,
        "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
        "mean_kl_by_quarter": [float(kl[i * n // 4 : (i + 1) * n // 4].mean()) for i in range(4)],
        "top1_agreement": float(agree.float().mean()), "disagreements": int((~agree).sum()),
        "disagreement_gaps_max": float(gaps.max()) if gaps.numel() else None,
        "disagreements_at_gap_under_0.1": int((gaps < 0.1).sum()),
        "positions_at_gap_under_0.1": float((gap < 0.1).float().mean()),
        "mean_top1_probability": float(rows["top1"].mean()),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path)
    source.add_argument("--packaged", action="store_true")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--against", type=Path, default=None, help="llama.cpp on this file (e.g. the F16 the "
                        "--gguf file was quantised from) as the reference instead of specchat: the KL a "
                        "quantisation costs in llama.cpp itself, both through --gguf's output layer")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8937)
    parser.add_argument("--cache-type", default="f16", help="llama.cpp's KV cache type (f16, its default; bf16, f32)")
    parser.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/llama.cpp-bin/src/build/bin")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.models.catalog.config import load_pairs
    from specchat.backend.models.loading.loaded import packaged_gguf_path

    gguf = packaged_gguf_path() if args.packaged else args.gguf
    with tempfile.TemporaryDirectory() as folder:
        pairs = Path(folder) / "models.yaml"
        pairs.write_text(f"pairs:\n  - name: bench\n    target:\n      source: {gguf}\n    drafter: none\n"
                         f"    context_length: {args.tokens + 64}\n")  # fmt: skip
        engine = load_engine(load_pairs(pairs)["bench"], device="cpu")
    if engine.runner.native is None:
        raise SystemExit(f"the native model does not run {gguf}: {engine.start_line}")
    ids = engine.tokenizer.encode(_text(), add_special_tokens=False)[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    cache = ["-ctk", args.cache_type, "-ctv", args.cache_type]
    theirs_hidden = llama_hidden(args.llama_bin, gguf, ids, args.threads, args.port, cache)
    summary: dict[str, object] = {"file": gguf.name, "llama_cache": args.cache_type,
                                  "architecture": engine.runner.native.arch.family}  # fmt: skip
    rows: list[dict[str, torch.Tensor]] = []
    if args.against is not None:  # llama.cpp against itself: the --against file's states as the reference
        summary["reference"] = f"llama.cpp on {args.against.name}"
        ref_hidden = llama_hidden(args.llama_bin, args.against, ids, args.threads, args.port, cache)
        for start in range(0, len(ids), CHUNK):
            part = slice(start, start + CHUNK)
            rows.append(_compare(_head(engine, ref_hidden[part]), _head(engine, theirs_hidden[part])))
        hidden = ref_hidden
    else:
        summary["reference"] = "llama.cpp"
        ours_hidden = []
        for start, (chunk_hidden, ours) in zip(range(0, len(ids), CHUNK), _specchat(engine, ids)):
            ours_hidden.append(chunk_hidden)
            rows.append(_compare(_head(engine, theirs_hidden[start : start + CHUNK]), ours))
        hidden = torch.cat(ours_hidden)
    if theirs_hidden.shape != hidden.shape:
        raise SystemExit(f"llama-server returned {tuple(theirs_hidden.shape)}, the reference {tuple(hidden.shape)}")
    summary.update(_report({key: torch.cat([row[key] for row in rows]) for key in rows[0]}))
    relative = ((hidden - theirs_hidden).norm(dim=-1) / theirs_hidden.norm(dim=-1)).median()
    summary["median_relative_hidden_difference"] = float(relative)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
