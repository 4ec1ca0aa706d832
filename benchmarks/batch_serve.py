"""N concurrent clients against `specchat serve` (one at a time, and continuous batching with speculation forced on,
forced off and as the policy chooses) and against `llama-server -np N` (plain, and its n-gram speculation when the
build has it), on the same GGUF and threads (issue 45).

Each client sends ``--requests`` chat completions one after another (streaming, greedy, ``--max-tokens``), the
prompts taken in turn from the bench's code-edit and chat sets (backend/bench/data), so a run mixes replies prompt
lookup drafts well (edits: the reply copies the prompt) and poorly (chat). Per mode and concurrency it prints:
aggregate tok/s (completion tokens of all clients / wall time from the first request to the last reply), time to
first token p50, per-stream tok/s p50 / p95 (a reply's tokens over its time from the first token to the last),
and the policy's crossover table (batch tok/s with speculation on, off, and as the policy chose).

    python benchmarks/batch_serve.py --concurrency 1 2 4 8 16 --requests 2 --max-tokens 96 [--rounds 2] \\
        [--llama-bin ~/.cache/llama.cpp-bin/src/build/bin] [--threads 2] [--json out.json] [--gguf FILE]

``--gguf FILE`` serves that file on both sides instead of the embedded default (a pair written to a temporary
models.yaml, context 4096; e.g. the 1B file of ``benchmarks/make_gguf.py --type q4_0``).

Modes (one server per kind; `specchat serve --parallel 16` serves every batch mode, the request's ``specchat`` field
choosing the drafter and γ): ``serve-1`` (`--parallel 1`, prompt lookup, γ auto: one at a time, the others queue),
``batch-policy`` (prompt lookup, γ auto: the batch policy), ``batch-on`` (prompt lookup, γ fixed at ``--gamma``),
``batch-off`` (no drafter), ``llama`` (`llama-server -np 16 -no-kvu`, 4,096 tokens a slot: a unified cache of 65,536
cells made every step attend over all of them, 3 tok/s), ``llama-ngram`` (with ``--spec-type ngram-simple``, a
3-token lookup and drafts of up to 8, when this build knows it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[1] / "backend" / "bench" / "data"
SLOTS = 16


def prompts() -> list[list[dict]]:
    edits = [json.loads(line)["messages"] for line in (DATA / "code_edit.jsonl").read_text().splitlines()]
    chat = [
        [{"role": "user", "content": json.loads(line)["turns"][0]}]
        for line in (DATA / "spec_bench.jsonl").read_text().splitlines()[:16]
    ]
    mixed = []
    for i in range(max(len(edits), len(chat))):
        mixed += [edits[i % len(edits)], chat[i % len(chat)]]
    return mixed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{what} did not come up")


def specchat_server(parallel: int, threads: int, pair: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # No prefix cache: every mode sends the same prompts, and a later mode would read the earlier one's.
    command = ["specchat", "serve", "--port", str(port), "--parallel", str(parallel), "--queue", "64", "--log", "off",
               "--prefix-cache-mb", "0", *pair]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stderr=open(f"/tmp/specchat-serve-{parallel}.log", "w"))  # noqa: SIM115
    wait_up(f"http://127.0.0.1:{port}/health", proc, "specchat serve")
    return proc, f"http://127.0.0.1:{port}/v1"


def llama_server(bin_dir: Path, gguf: str, threads: int, ngram: bool) -> tuple[subprocess.Popen, str] | None:
    port = free_port()
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    command = [str(bin_dir / "llama-server"), "-m", gguf, "-t", str(threads), "-tb", str(threads),
               "-c", str(4096 * SLOTS), "-np", str(SLOTS), "-no-kvu", "--port", str(port), "--no-warmup"]  # fmt: skip
    if ngram:
        helptext = subprocess.run([command[0], "--help"], env=env, capture_output=True, text=True).stdout
        if "ngram-simple" not in helptext:
            return None
        # Prompt lookup's shape: a 3-token match, drafts of up to 8.
        command += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_up(f"http://127.0.0.1:{port}/health", proc, "llama-server")
    return proc, f"http://127.0.0.1:{port}/v1"


def one_reply(url: str, model: str, messages: list[dict], max_tokens: int, spec: dict | None) -> dict:
    body: dict = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if spec is not None:
        body["specchat"] = spec
    t0 = time.perf_counter()
    first, tokens, chunks = None, None, 0
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for choice in data.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    chunks += 1
                    first = first or time.perf_counter()
    end = time.perf_counter()
    return {"start": t0, "first": first or end, "end": end, "tokens": tokens or chunks}


def run_mode(url: str, model: str, clients: int, requests: int, max_tokens: int, spec: dict | None) -> dict:
    """``model``: the served pair's name (llama-server takes any)."""
    pool = prompts()
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            got = one_reply(url, model, pool[(c * requests + r) % len(pool)], max_tokens, spec)
            with lock:
                results.append(got)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"replies": results, "wall_s": time.perf_counter() - t0}


def summary(runs: list[dict]) -> dict:
    """One mode at one concurrency over its rounds: tokens and wall time summed, percentiles over every reply."""
    replies = [r for run in runs for r in run["replies"]]
    wall = sum(run["wall_s"] for run in runs)
    rates = sorted(r["tokens"] / max(r["end"] - r["first"], 1e-9) for r in replies)
    return {
        "aggregate_tok_s": sum(r["tokens"] for r in replies) / wall,
        "ttft_p50_s": statistics.median(r["first"] - r["start"] for r in replies),
        "stream_tok_s_p50": statistics.median(rates),
        "stream_tok_s_p95": rates[min(len(rates) - 1, int(0.95 * len(rates)))],
        "tokens": sum(r["tokens"] for r in replies),
        "wall_s": wall,
        "rounds": [sum(r["tokens"] for r in run["replies"]) / run["wall_s"] for run in runs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4, help="γ of the batch-on mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bin", type=Path, default=None)
    parser.add_argument("--llama-concurrency", type=int, nargs="+", default=None,
                        help="the concurrencies llama-server runs at (default: all)")  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per concurrency (summed)")
    parser.add_argument("--gguf", type=Path, default=None, help="serve this GGUF (default: the embedded model's)")
    args = parser.parse_args()
    pair: list[str] = []
    model = "bench-gguf" if args.gguf is not None else "smollm2-135m"
    if args.gguf is not None:
        gguf = str(args.gguf.resolve())
        models = Path(tempfile.mkdtemp(prefix="batch-serve-")) / "models.yaml"
        models.write_text(
            f"pairs:\n  - name: bench-gguf\n    target:\n      source: {gguf}\n    context_length: 4096\n"
        )
        pair = ["--models", str(models), "--pair", "bench-gguf"]
    else:
        gguf = subprocess.run(
            [sys.executable, "-c", "from specchat.backend.models.catalog.config import load_pairs; "
             "print(load_pairs()['smollm2-135m'].target.facts_file)"], capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    specs = {
        "serve-1": {"drafter": "prompt-lookup"},
        "batch-policy": {"drafter": "prompt-lookup"},
        "batch-on": {"drafter": "prompt-lookup", "gamma": args.gamma},
        "batch-off": {"drafter": "none"},
    }
    modes = args.modes or [*specs, "llama", "llama-ngram"]
    servers: dict[str, tuple[subprocess.Popen, str] | None] = {}
    try:
        if "serve-1" in modes:
            servers["serve-1"] = specchat_server(1, args.threads, pair)
        if any(m.startswith("batch") for m in modes):
            servers["batch"] = specchat_server(SLOTS, args.threads, pair)
        if args.llama_bin is not None:
            for mode in ("llama", "llama-ngram"):
                if mode in modes:
                    servers[mode] = llama_server(args.llama_bin, gguf, args.threads, mode == "llama-ngram")
        table: dict[str, dict[int, dict]] = {}
        runs: dict[tuple[str, int], list[dict]] = {}
        for turn, clients in enumerate(args.concurrency):
            # Interleaved: every mode at this concurrency, then the next; the order rotates so no mode is always
            # first (llama-server keeps its slots' prompts, a cache of its own per mode's server).
            for rnd in range(args.rounds):
                shift = (turn + rnd) % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    server = servers.get("batch" if mode.startswith("batch") else mode)
                    if server is None:
                        continue
                    if mode.startswith("llama") and args.llama_concurrency and clients not in args.llama_concurrency:
                        continue
                    run_mode(server[1], model, 1, 1, 8, specs.get(mode))  # warm: first-request costs out of the figures
                    runs.setdefault((mode, clients), []).append(
                        run_mode(server[1], model, clients, args.requests, args.max_tokens, specs.get(mode))
                    )
            for mode in modes:
                if (mode, clients) not in runs:
                    continue
                got = table.setdefault(mode, {})[clients] = summary(runs[(mode, clients)])
                print(f"{mode:13s} c={clients:2d}  {got['aggregate_tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{got['ttft_p50_s'] * 1000:7.0f} ms  stream p50 {got['stream_tok_s_p50']:6.1f} p95 "
                      f"{got['stream_tok_s_p95']:6.1f} tok/s  ({got['tokens']} tokens; rounds "
                      f"{' '.join(f'{x:.1f}' for x in got['rounds'])})", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            if server is not None:
                server[0].terminate()
                server[0].wait(30)
    print("\ncrossover (aggregate tok/s): concurrency, spec on, spec off, policy, policy / best")
    for clients in args.concurrency:
        row = [
            table.get(m, {}).get(clients, {}).get("aggregate_tok_s") for m in ("batch-on", "batch-off", "batch-policy")
        ]
        if None not in row:
            on, off, policy = row
            print(f"  {clients:2d}  {on:7.1f}  {off:7.1f}  {policy:7.1f}  {policy / max(on, off):.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
