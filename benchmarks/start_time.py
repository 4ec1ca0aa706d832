"""Start time and resident memory of a pair (issue 16's figures): ``load_engine`` in a fresh process.

Each run is a new Python process that imports torch, then times ``load_engine(pair)`` (what the UI's
"ready in N s" counts, less its UI work) and reads its resident memory (VmRSS) afterwards. ``--first`` gives
each run an empty temporary ``SPECCHAT_CACHE_DIR``, as on a new machine (the one-time conversion of the GGUF's
tokenizer and configuration included); otherwise the user's cache is used, as on every later start. Prints one
line per run and the median; measure on a quiet machine.

    python benchmarks/start_time.py --runs 3 [--first] [--pair smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import load_pairs
pair = load_pairs()[sys.argv[1]]
t2 = time.perf_counter()
load_engine(pair)
t3 = time.perf_counter()
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024
print(json.dumps({"import_torch_s": t1 - t0, "load_engine_s": t3 - t2, "rss_mb": rss}))
"""


def run_once(pair: str, first: bool) -> dict:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if first:
            env["SPECCHAT_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, "-c", CHILD, pair], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--first", action="store_true", help="an empty model cache each run (a new machine)")
    args = parser.parse_args()
    results = []
    for i in range(args.runs):
        result = run_once(args.pair, args.first)
        results.append(result)
        print(
            f"run {i + 1}: import torch {result['import_torch_s']:.2f} s, load_engine "
            f"{result['load_engine_s']:.2f} s, resident {result['rss_mb']:.0f} MB",
            flush=True,
        )
    kind = "first start" if args.first else "next start"
    print(
        f"{args.pair} {kind}: load_engine median {statistics.median(r['load_engine_s'] for r in results):.2f} s, "
        f"resident median {statistics.median(r['rss_mb'] for r in results):.0f} MB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
