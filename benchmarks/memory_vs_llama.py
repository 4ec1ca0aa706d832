"""Peak resident memory of the whole process, specchat against llama-server, on the same GGUF file and context
(issue 48 item 1), beside specchat's own estimate (`specchat models`) per component.

Each side is a fresh process given the same prompt, ``--fill`` tokens of plain text (default: most of the
context, so the KV cache is as full as a long chat makes it), then ``--tokens`` greedy new tokens; its peak
resident memory (VmHWM, every byte the process held at its largest: the runtime, the weights, the KV cache,
buffers) is read from /proc at the end. specchat's side also reports its resident memory before loading (the
runtime: Python, torch), after loading, and after the reply.

    python benchmarks/memory_vs_llama.py --packaged [--context 8192] [--fill 7000]
    python benchmarks/memory_vs_llama.py --gguf /tmp/bench-qwen2-152k-q8_0.gguf
    python benchmarks/memory_vs_llama.py --packaged --skip-llama       # specchat's side only
    # a full context with sampled verification of 32 rows (the estimate's case):
    python benchmarks/memory_vs_llama.py --gguf FILE --fill 8000 --drafter prompt-lookup --gamma 31 --temperature 0.8

llama.cpp binaries: ``--llama-bin`` (default ~/.cache/llama.cpp-bin/src/build/bin; LD_LIBRARY_PATH is set to it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from specchat.backend.bench.llama_server import LlamaServer

CHILD = """
import json, sys
def status():
    fields = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) * 1024
    return fields
from specchat.backend.engine.heap import one_arena
one_arena()  # as the specchat command does first
import torch
from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.facts.memory import estimate_pair, runtime_bytes
torch.set_num_threads(int(sys.argv[3]))
pair = load_pairs(sys.argv[1])["bench"]
runtime = status()["VmRSS"]
engine = load_engine(pair)
loaded = status()["VmRSS"]
prompt = open(sys.argv[2]).read()
drafter, gamma, temperature = sys.argv[5], sys.argv[6], float(sys.argv[7])
gamma = int(gamma) if gamma.isdigit() else gamma
sampling = SamplingParams(temperature=temperature, max_new_tokens=int(sys.argv[4]), seed=0)
request = GenerationRequest(messages=[{"role": "user", "content": prompt}], keep_all_messages=True,
                            sampling=sampling, drafter=drafter, gamma=gamma)
tokens = 0
for event in engine.generate(request):
    tokens += len(event.token_ids)
end = status()
estimate = estimate_pair(pair, torch.device("cpu"))
print(json.dumps({"runtime": runtime, "loaded": loaded, "end": end["VmRSS"], "peak": end["VmHWM"],
                  "prompt_tokens": event.stats.prompt_tokens, "new_tokens": tokens, "path": engine.start_line,
                  "estimate": {"weights": estimate.target_weights, "kv": estimate.target_kv,
                               "scratch": estimate.scratch, "runtime": estimate.runtime,
                               "headroom": estimate.headroom, "process": estimate.process},
                  "runtime_estimate": runtime_bytes(pair.target)}))
"""


def _text(words: int) -> str:
    """Plain English-like text of ``words`` words (no repetition a drafter could use: drafter none anyway)."""
    import random

    vocabulary = (
        "the river town light stone window garden morning letter quiet road summer harbour evening bridge market "
        "winter village field story lantern keeper message bottle shore"
    ).split()
    rng = random.Random(0)
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def specchat(gguf: Path, context: int, prompt: Path, threads: int, tokens: int, drafter: str = "none",
             gamma: str = "auto", temperature: float = 0.0) -> dict:  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        pairs = Path(folder) / "models.yaml"
        pairs.write_text(f"pairs:\n  - name: bench\n    target:\n      source: {gguf}\n    drafter: none\n"
                         f"    context_length: {context}\n")  # fmt: skip
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(pairs),
                str(prompt),
                str(threads),
                str(tokens),
                drafter,
                gamma,
                str(temperature),
            ],  # fmt: skip
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"specchat failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_server(bin_dir: Path, gguf: Path, context: int, prompt: Path, threads: int, tokens: int, port: int) -> dict:
    server = LlamaServer(bin_dir / "llama-server", gguf, spec_type=None, threads=threads, context_length=context,
                         startup_s=300, port=port)  # fmt: skip
    try:
        body = {"messages": [{"role": "user", "content": prompt.read_text()}], "max_tokens": tokens, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=1200) as answer:
            reply = json.loads(answer.read())
        fields = {}
        assert server.process is not None
        for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) * 1024
        return {"end": fields["VmRSS"], "peak": fields["VmHWM"], "prompt_tokens": reply["usage"]["prompt_tokens"]}
    finally:
        server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path)
    source.add_argument("--packaged", action="store_true")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--fill", type=int, default=None, help="words of prompt (default: context x 0.6)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--drafter", default="none", help="specchat's drafter (llama-server runs without one)")
    parser.add_argument("--gamma", default="auto", help="drafted tokens per step (with --drafter)")
    parser.add_argument("--temperature", type=float, default=0.0, help="with a seed: sampled verification's buffers")
    parser.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/llama.cpp-bin/src/build/bin")
    args = parser.parse_args()
    if args.packaged:
        # spec_facts's lookup, not loaded.py's: this process must not import torch, or the child's torch pages
        # would be shared with it, which Linux does not page out (backend/engine/heap.py)
        from specchat.backend.models.facts.spec_facts import packaged_gguf_path

        gguf = packaged_gguf_path()
    else:
        gguf = args.gguf
    with tempfile.TemporaryDirectory() as folder:
        prompt = Path(folder) / "prompt.txt"
        prompt.write_text(_text(args.fill or int(args.context * 0.6)))
        ours = specchat(gguf, args.context, prompt, args.threads, args.tokens, args.drafter, args.gamma,
                        args.temperature)  # fmt: skip
        mib = 2**20
        line = {
            "file": gguf.name,
            "context": args.context,
            "specchat_peak_mib": round(ours["peak"] / mib),
            "specchat_runtime_mib": round(ours["runtime"] / mib),
            "specchat_loaded_mib": round(ours["loaded"] / mib),
            "prompt_tokens": ours["prompt_tokens"],
            "drafter": args.drafter,
            "estimate_mib": {k: round(v / mib) for k, v in ours["estimate"].items()},
        }
        line["estimate_vs_peak"] = round(ours["estimate"]["process"] / ours["peak"], 3)
        if not args.skip_llama:
            theirs = llama_server(args.llama_bin, gguf, args.context, prompt, args.threads, args.tokens, args.port)
            line["llama_server_peak_mib"] = round(theirs["peak"] / mib)
            line["llama_prompt_tokens"] = theirs["prompt_tokens"]
            line["difference_mib"] = line["specchat_peak_mib"] - line["llama_server_peak_mib"]
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
