"""specchat's CPU native model against llama.cpp on the same GGUF file and threads, in one interleaved run (a
script, not a test; run it under /work/tools/cpu-exclusive or on an otherwise quiet machine).

Measures, alternating the two sides ``--rounds`` times and reporting medians:

- plain greedy decoding: specchat's engine (drafter none) against ``llama-server``'s ``/completion`` on the same
  prompt, ``--tokens`` new tokens, decoding tok/s (after the prompt: llama-server's ``predicted_per_second``,
  specchat's tokens after the first over the time since it);
- a 16-row pass: specchat's forward over 16 new tokens after a 64-token prompt, against ``llama-bench -p 16``
  (prompt processing of 16 tokens), in tok/s;
- specchat's resident memory after loading (VmRSS), beside the file's size and the KV cache's.

    python benchmarks/native_vs_llama.py --gguf /tmp/bench-1b-q4_0.gguf [--threads 2] [--tokens 64]
    python benchmarks/native_vs_llama.py --packaged          # the embedded default's GGUF

llama.cpp binaries: ``--llama-bin`` (default ~/.cache/llama.cpp-bin/src/build/bin; LD_LIBRARY_PATH is set to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Begin:"


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _pair_file(gguf: Path, folder: Path) -> Path:
    """A one-pair models.yaml naming the file alone: its sizes come from the GGUF's metadata."""
    path = folder / "models.yaml"
    path.write_text(f"pairs:\n  - name: bench\n    target:\n      source: {gguf}\n    drafter: none\n"
                    "    context_length: 2048\n")  # fmt: skip
    return path


def _specchat_decode(engine, tokens: int) -> float:
    from specchat.backend.api import GenerationRequest, SamplingParams

    request = GenerationRequest(
        messages=[{"role": "user", "content": PROMPT}],
        sampling=SamplingParams(temperature=0.0, max_new_tokens=tokens, seed=0, stop=()),
        drafter="none",
    )
    first, count, last = None, 0, None
    for event in engine.generate(request):
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            count += len(event.token_ids)
        last = now
    return count / (last - first) if count else float("nan")


def _specchat_pass16(engine) -> float:
    runner = engine.runner
    ids = torch.randint(100, 40000, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = runner.cache.new_sequence()
    runner.forward(seq, ids[:64])
    seq.commit(64)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        runner.forward(seq, ids[64:80], logits_to_keep=16)
        best = min(best, time.perf_counter() - started)
    seq.free()
    return 16 / best


def _server(bin_dir: Path, gguf: Path, threads: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", "2048",
               "--port", str(port), "-np", "1", "--no-warmup"]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("llama-server did not come up")


def _server_decode(port: int, tokens: int) -> float:
    messages = [{"role": "user", "content": PROMPT}]
    body = json.dumps({"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        reply = json.loads(answer.read())
    return float(reply["timings"]["predicted_per_second"])


def _llama_bench(bin_dir: Path, gguf: Path, threads: int) -> float:
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    done = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "16", "-n", "0", "-o", "json"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(json.loads(done.stdout)[0]["avg_ts"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path)
    source.add_argument("--packaged", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8917)
    parser.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/llama.cpp-bin/src/build/bin")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.models.catalog.config import load_pairs
    from specchat.backend.models.loading.pair import packaged_gguf_path

    gguf = packaged_gguf_path() if args.packaged else args.gguf
    with tempfile.TemporaryDirectory() as folder:
        pair = load_pairs(_pair_file(gguf, Path(folder)))["bench"]
    before = _rss_mb()
    engine = load_engine(pair, device="cpu")
    engine.threads = None  # hold the thread count fixed (no governor)
    rss = _rss_mb()
    kv = engine.cache.k.numel() * engine.cache.k.element_size() * 2 / 2**20
    print(f"file {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB); {engine.start_line}; threads {args.threads}")
    print(f"resident after load: {rss:.0f} MiB (before loading: {before:.0f} MiB); KV cache reserved {kv:.0f} MiB")
    from specchat.backend.models.facts.memory import estimate_pair

    estimate = estimate_pair(pair, torch.device("cpu"))
    print(f"estimate ({'known' if estimate.known else 'unknown'}): {estimate.total / 2**20:.0f} MiB "
          f"({estimate.describe(pair.context_length)})")  # fmt: skip
    server = _server(args.llama_bin, gguf, args.threads, args.port)
    ours, theirs, ours16, theirs16 = [], [], [], []
    try:
        _server_decode(args.port, 8)
        _specchat_decode(engine, 8)  # warm-ups
        for _ in range(args.rounds):
            ours.append(_specchat_decode(engine, args.tokens))
            theirs.append(_server_decode(args.port, args.tokens))
    finally:
        server.kill()
        server.wait()
    for _ in range(args.rounds):
        ours16.append(_specchat_pass16(engine))
        theirs16.append(_llama_bench(args.llama_bin, gguf, args.threads))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"plain decoding, {args.tokens} tokens: specchat {a:.2f} tok/s, llama-server {b:.2f} tok/s: {a / b:.2f}x "
          f"(rounds: {[round(x, 2) for x in ours]} / {[round(x, 2) for x in theirs]})")  # fmt: skip
    a, b = statistics.median(ours16), statistics.median(theirs16)
    print(f"16-row pass: specchat {a:.1f} tok/s, llama-bench -p 16 {b:.1f} tok/s: {a / b:.2f}x")
    print(f"resident after the run: {_rss_mb():.0f} MiB")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
