"""Tokens/s of a reply through `specchat serve` against the same reply from `specchat generate` (issue 18's check:
the API should cost little, goal >= 0.95x).

Each round starts a fresh `specchat serve --port 0` (so its reply is its engine's first, like generate's) and runs,
in an order that alternates per round:

- ``specchat generate --json`` (local): its ``stats.tok_s``;
- ``specchat generate --json --pair served`` against that server (a remote pair, kind specchat): its
  ``stats.tok_s``, measured by the client from its request's start to the last token, network and JSON included.

Both greedy, the same prompt and ``--max-new-tokens``; the token ids must be equal (the script says when not).
``--drafter`` is passed to both (default: the pair's own). Prints one line per run, then the median of the per-round
ratios served/local and the ratio of the medians; exits 1 when the median ratio is below ``--goal``.

    python benchmarks/serve_vs_generate.py --rounds 6 --max-new-tokens 128 [--drafter none]

On a loaded CPU (more runnable threads than cores), torch's two OpenMP threads make a reply decoded in a process's
main thread (`specchat generate`) many times slower than one decoded in a worker thread (the server's engine
owner); ``OMP_NUM_THREADS=1`` in the environment (passed to both) takes that out of the comparison.
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
from pathlib import Path

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


def start_server(env: dict[str, str], *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        ["specchat", "serve", "--pair", "smollm2-135m", "--port", "0", *extra],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stderr.readline() if proc.stderr else ""
        if line.startswith("specchat serve: pair"):
            return proc, line.split(" on ", 1)[1].split(" ", 1)[0]
    proc.kill()
    raise SystemExit("specchat serve did not start")


def generate(prompt: str, max_new: int, env: dict[str, str], drafter: str | None, *extra: str) -> dict:
    args = [
        "specchat",
        "generate",
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(max_new),
        "--temperature",
        "0",
        "--json",
        *(["--drafter", drafter] if drafter else []),
        *extra,
    ]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", default=None, help="none | prompt-lookup | auto (default: the pair's)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--goal", type=float, default=0.95)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SPECCHAT_CONFIG_DIR=str(Path(tmp) / "config"), SPECCHAT_DATA_DIR=str(Path(tmp) / "data"))
        models = Path(tmp) / "served.yaml"
        ratios, local_rates, served_rates = [], [], []
        for index in range(args.rounds):
            proc, url = start_server(env)
            try:
                models.write_text(
                    f"pairs:\n  - name: served\n    target: {{server: {url}, model: smollm2-135m, kind: specchat}}\n",
                    encoding="utf-8",
                )
                runs = {}
                order = ("local", "served") if index % 2 == 0 else ("served", "local")
                for which in order:
                    extra = ("--models", str(models), "--pair", "served") if which == "served" else ()
                    runs[which] = generate(args.prompt, args.max_new_tokens, env, args.drafter, *extra)
            finally:
                proc.terminate()
                proc.wait(60)
            local, served = runs["local"], runs["served"]
            same = local["token_ids"] == served["token_ids"]
            rate_l, rate_s = local["stats"]["tok_s"], served["stats"]["tok_s"]
            local_rates.append(rate_l)
            served_rates.append(rate_s)
            ratios.append(rate_s / rate_l)
            print(
                f"round {index + 1} ({'/'.join(order)}): generate {rate_l:.2f} tok/s, serve {rate_s:.2f} tok/s "
                f"({len(served['token_ids'])} tokens, {'same tokens' if same else 'TOKENS DIFFER'}), "
                f"ratio {rate_s / rate_l:.3f}",
                flush=True,
            )
    median = statistics.median(ratios)
    print(
        f"median ratio serve/generate {median:.3f} over {args.rounds} rounds (ratio of medians "
        f"{statistics.median(served_rates) / statistics.median(local_rates):.3f}); drafter "
        f"{args.drafter or 'the pair'}; goal >= {args.goal}"
    )
    return 0 if median >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
