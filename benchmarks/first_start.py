"""First start and later starts of the embedded default (issue 48 item 3): what a user waits for on a new machine.

Each measurement is a fresh process given empty cache folders (``SPECCHAT_CACHE_DIR`` and
``SPECCHAT_NATIVE_CACHE``: no converted tokenizer, no CPU kernels), timed from just before the process is
started:

- ``background`` (the default behaviour): the seconds to the first reply (16 greedy tokens), then the process
  keeps replying every ``--every`` seconds until the native model has taken over (``engine.runner.path``), and
  reports when that happened and each path's decoding rate;
- ``wait`` (``SPECCHAT_NATIVE_BUILD=wait``: the start waits for the compiler, as before): the seconds to the
  first reply;
- ``later``: a start that finds both caches filled, to the first reply.

    python benchmarks/first_start.py [--modes background,later,wait] [--every 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import load_pairs

def say(**fields):
    print(json.dumps({"at": time.time(), **fields}), flush=True)

engine = load_engine(load_pairs()["smollm2-135m"])
say(event="loaded", line=engine.start_line)
request = GenerationRequest(messages=[{"role": "user", "content": "Say hi."}],
                            sampling=SamplingParams(temperature=0, max_new_tokens=16), drafter="none")
follow, every = sys.argv[1] == "1", float(sys.argv[2])
while True:
    last = None
    for event in engine.generate(request):
        last = event
    say(event="reply", path=engine.runner.path, tok_s=last.stats.tok_s, line=engine.start_line)
    if not follow or engine.runner.path == "cpu-native":
        break
    time.sleep(every)
"""


def run(mode: str, native_cache: str, cache: str, every: float) -> list[dict]:
    env = {**os.environ, "SPECCHAT_CACHE_DIR": cache, "SPECCHAT_NATIVE_CACHE": native_cache}
    env["SPECCHAT_NATIVE_BUILD"] = "wait" if mode == "wait" else "background"
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if mode == "background" else "0", str(every)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode}: the child failed:\n{done.stderr[-3000:]}")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for event in events:
        event["s"] = round(event.pop("at") - started, 1)
    return events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="background,later,wait")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between replies while waiting for the swap")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        fresh = 0
        folders = (os.path.join(root, "native0"), os.path.join(root, "cache0"))
        for mode in args.modes.split(","):
            if mode != "later":  # a first start: empty caches of its own
                fresh += 1
                folders = (os.path.join(root, f"native{fresh}"), os.path.join(root, f"cache{fresh}"))
            events = run(mode, *folders, args.every)
            first = next(e for e in events if e["event"] == "reply")
            summary = {"mode": mode, "first_reply_s": first["s"], "first_path": first["path"], "line": first["line"]}
            native = [e for e in events if e["event"] == "reply" and e["path"] == "cpu-native"]
            if mode == "background" and native:
                summary["native_from_s"] = native[0]["s"]
                summary["tok_s_before"] = first["tok_s"]
                summary["tok_s_after"] = native[0]["tok_s"]
            print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
