"""`specchat serve` as a user starts it (its own process, the embedded default pair, 127.0.0.1): greedy output over
the API equals `specchat generate`'s, token for token, and the engine holds no KV block afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specchat.app.cli.main import main

pytestmark = pytest.mark.slow
PROMPT = "Write a Python function that returns the sum of a list of numbers."


def _generate(capsys, *args: str) -> dict:
    assert (
        main(
            [
                "generate",
                "--prompt",
                PROMPT,
                "--temperature",
                "0",
                "--max-new-tokens",
                "48",
                "--json",
                "--device",
                "cpu",
                *args,
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


def test_greedy_output_over_the_api_equals_specchat_generate(tmp_path: Path, capsys) -> None:
    # -X faulthandler: a server that does not stop is made to print every thread's stack (below). SIGINT is set
    # back to its default in the child, as a terminal's Ctrl+C finds it: a test run started in the background by a
    # non-interactive shell inherits it ignored, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "specchat.app.cli.main",
            "serve",
            "--pair",
            "smollm2-135m",
            "--port",
            "0",
            "--device",
            "cpu",
        ],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        url = ""
        deadline = time.monotonic() + 300
        while not url and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline() if proc.stderr else ""
            if line.startswith("specchat serve: pair"):
                url = line.split(" on ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:"), "the server did not start"
        models = tmp_path / "remote.yaml"
        models.write_text(
            f"pairs:\n  - name: served\n    target: {{server: {url}, model: smollm2-135m, kind: specchat}}\n",
            encoding="utf-8",
        )
        local = _generate(capsys)
        remote = _generate(capsys, "--models", str(models), "--pair", "served")
        assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]
        assert remote["finish_reason"] == local["finish_reason"]
        assert set(remote["stats"]) == set(local["stats"])
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
        # Nothing leaks: the blocks held are the prefix cache's entry for this client, the prompt and the reply's
        # tokens but the last (whose K/V no pass computed), 16 tokens a block.
        kept = local["stats"]["prefill_tokens"] + local["stats"]["new_tokens"] - 1  # a cold request: the whole prompt
        assert f"specchat_kv_blocks_in_use {-(-kept // 16)}\n" in metrics
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler dumps the threads' stacks to stderr
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"specchat serve did not stop within 60 s of Ctrl+C; its stderr's end:\n{err[-6000:]}")
        assert code == 0
