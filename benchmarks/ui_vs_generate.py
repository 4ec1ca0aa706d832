"""Tokens/s of a reply in the chat UI against `specchat generate` on the same prompt (issue 5's check).

Each round runs both, in a fresh process each (so each reply is its process's first, model cache warm):

- ``specchat generate --json`` with the prompt, greedy, ``--max-new-tokens N``: its ``stats.tok_s``;
- ``specchat`` in a real terminal (a detached tmux session, 120x40), the same settings written to its
  settings file, the prompt typed and sent with Enter; the reply's ``tok_s`` is read back from the history
  database once the reply is saved (the same engine statistic the reply's totals line shows).

The order alternates per round so drift in machine speed hits both. Both use a temporary config/data dir
(``SPECCHAT_CONFIG_DIR`` / ``SPECCHAT_DATA_DIR``) and the user's model cache. Prints one line per run and the
medians; exits 1 when the UI's median is more than ``--tolerance`` below generate's.

    python benchmarks/ui_vs_generate.py --rounds 5 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


def run_generate(prompt: str, max_new: int, env: dict[str, str], drafter: str | None = None) -> dict:
    extra = ["--drafter", drafter] if drafter else []
    out = subprocess.run(
        [
            "specchat",
            "generate",
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(max_new),
            "--temperature",
            "0",
            "--json",
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    record = json.loads(out.stdout.strip().splitlines()[-1])
    return record["stats"]


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _reply_stats(db: Path) -> dict | None:
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            rows = conn.execute(
                "SELECT stats FROM messages WHERE role = 'assistant' AND complete = 1 "
                "AND stats IS NOT NULL ORDER BY id DESC LIMIT 1"
            ).fetchall()
    except sqlite3.Error:
        return None
    if not rows or not rows[0][0]:
        return None
    stats = json.loads(rows[0][0])
    return stats if stats.get("finish_reason") else None


def run_ui(prompt: str, max_new: int, env: dict[str, str], home: Path, timeout: float = 600) -> dict:
    session = f"specchat-speed-{os.getpid()}"
    db = home / "data" / "history.sqlite3"
    for old in home.joinpath("data").glob("history.sqlite3*"):
        old.unlink()
    command = " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("SPECCHAT_")) + " specchat"
    for _ in range(3):  # a tmux server still exiting from the last run can refuse the new session
        started = subprocess.run(
            ["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", command],
            env=env,
            capture_output=True,
            text=True,
        )
        if started.returncode == 0:
            break
        time.sleep(1.0)
    else:
        raise RuntimeError(f"tmux could not start the UI: {started.stderr.strip()}")
    try:
        deadline = time.monotonic() + timeout
        while "ready (" not in _pane(session):
            if time.monotonic() > deadline:
                raise RuntimeError("the UI did not get ready:\n" + _pane(session))
            time.sleep(0.2)
        subprocess.run(["tmux", "send-keys", "-t", session, "-l", prompt], check=True)
        subprocess.run(["tmux", "send-keys", "-t", session, "Enter"], check=True)
        # Poll the database only, once a second: a tmux capture-pane per poll costs CPU the reply would lose.
        while (stats := _reply_stats(db)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the reply did not finish:\n" + _pane(session))
            time.sleep(1.0)
        return stats
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def describe(stats: dict) -> str:
    """tok/s and what explains it: first-token time, decoding rate after it, target passes, tokens per pass."""
    tokens, wall, ttft = int(stats["new_tokens"]), float(stats["wall_s"]), float(stats.get("ttft_s") or 0.0)
    decode = (tokens - 1) / (wall - ttft) if wall > ttft else float("nan")
    return (
        f"{float(stats['tok_s']):6.2f} tok/s ({tokens} tokens; first token {ttft:.2f} s, then {decode:.2f} tok/s; "
        f"{stats.get('steps')} passes, τ {stats.get('mean_accepted_length') or 1:.2f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument(
        "--drafter",
        choices=["none", "prompt-lookup"],
        default=None,
        help="the drafter in both (default: the pair's); none gives both the same target passes",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specchat-speed-") as tmp:
        home = Path(tmp)
        (home / "config").mkdir()
        (home / "data").mkdir()
        settings = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
        if args.drafter:
            settings["drafter"] = args.drafter
        (home / "config" / "settings.json").write_text(json.dumps(settings))
        env = dict(os.environ, SPECCHAT_CONFIG_DIR=str(home / "config"), SPECCHAT_DATA_DIR=str(home / "data"))
        results: dict[str, list[float]] = {"generate": [], "ui": []}
        for round_ in range(args.rounds):
            order = ("generate", "ui") if round_ % 2 == 0 else ("ui", "generate")
            for which in order:
                if which == "generate":
                    stats = run_generate(args.prompt, args.max_new_tokens, env, args.drafter)
                else:
                    stats = run_ui(args.prompt, args.max_new_tokens, env, home)
                results[which].append(float(stats["tok_s"]))
                print(f"round {round_ + 1} {which:>8}: {describe(stats)}", flush=True)
    gen, ui = statistics.median(results["generate"]), statistics.median(results["ui"])
    print(f"median: generate {gen:.2f} tok/s, UI {ui:.2f} tok/s, UI/generate {ui / gen:.3f}")
    return 0 if ui >= (1 - args.tolerance) * gen else 1


if __name__ == "__main__":
    sys.exit(main())
