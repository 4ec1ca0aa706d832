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


def _llama_hidden(bin_dir: Path, gguf: Path, ids: list[int], threads: int, port: int, cache_type: str) -> torch.Tensor:
    """[n, hidden] float32: llama.cpp's final-norm output at every position of ``ids``."""
    n = len(ids)
    extra = ["-b", str(n + 16), "-ub", str(n + 16), "--embeddings", "--pooling", "none", "-ctk", cache_type,
             "-ctv", cache_type]  # fmt: skip
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


def _specchat(engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [n, hidden], log-probabilities [n, vocab]) of specchat's native pass over ``ids``."""
    native = engine.runner.native
    layers = native.arch.layers
    seq = engine.runner.cache.new_sequence()
    hidden, logprobs = [], []
    for start in range(0, len(ids), CHUNK):
        part = torch.tensor(ids[start : start + CHUNK], dtype=torch.long)
        logits, taps = native.forward(seq, part, part.numel(), None, [layers])
        seq.commit(part.numel())
        hidden.append(taps[0])
        logprobs.append(torch.log_softmax(logits.float(), dim=-1))
    seq.free()
    return torch.cat(hidden), torch.cat(logprobs)


def _head(engine, hidden: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``hidden`` [n, hidden] through specchat's output layer (and final soft-cap)."""
    native = engine.runner.native
    weight = native.head_weight if native.head_weight is not None else native.embed_weight
    out = []
    for start in range(0, hidden.shape[0], CHUNK):
        logits = weight.matmul(hidden[start : start + CHUNK].contiguous())
        cap = float(native.arch.final_softcap)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        out.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path)
    source.add_argument("--packaged", action="store_true")
    parser.add_argument("--tokens", type=int, default=4096)
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
    hidden, ours = _specchat(engine, ids)
    theirs_hidden = _llama_hidden(args.llama_bin, gguf, ids, args.threads, args.port, args.cache_type)
    if theirs_hidden.shape != hidden.shape:
        raise SystemExit(f"llama-server returned {tuple(theirs_hidden.shape)}, specchat {tuple(hidden.shape)}")
    theirs = _head(engine, theirs_hidden)
    kl = (theirs.exp() * (theirs - ours)).sum(-1).clamp_min(0)  # KL(llama.cpp || specchat) per position
    top_ours, top_theirs = ours.argmax(-1), theirs.argmax(-1)
    agree = top_ours == top_theirs
    probs = theirs.exp().topk(2, dim=-1).values
    gaps = (probs[:, 0] - probs[:, 1])[~agree]
    relative = ((hidden - theirs_hidden).norm(dim=-1) / theirs_hidden.norm(dim=-1)).median()
    quarters = [float(kl[i * len(ids) // 4 : (i + 1) * len(ids) // 4].mean()) for i in range(4)]
    print(json.dumps({
        "file": gguf.name, "llama_cache": args.cache_type, "architecture": engine.runner.native.arch.family,
        "positions": len(ids),
        "mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "mean_kl_by_quarter": quarters,
        "top1_agreement": float(agree.float().mean()), "disagreements": int((~agree).sum()),
        "disagreement_gaps_max": float(gaps.max()) if gaps.numel() else None,
        "disagreements_at_gap_under_0.1": int((gaps < 0.1).sum()),
        "median_relative_hidden_difference": float(relative),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
