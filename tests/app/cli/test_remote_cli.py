"""The CLI on a remote pair, against a real `specchat serve` on 127.0.0.1: `specchat generate --json` reports the
same fields as a local pair, `specchat models` lists remote pairs with a reachability check, `specchat bench` runs
mode server (and refuses transformers modes by name), `specchat serve` refuses a remote pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_fixtures import tiny_engine
from serve_fixtures import SlowEngine, closed_port, running_server, server_process

from specchat.app.cli.main import main
from specchat.backend.api import JSON_STATS_FIELDS


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def _models_file(tmp_path: Path, url: str, *, kind: str = "specchat", model: str = "tiny") -> Path:
    path = tmp_path / "remote.yaml"
    path.write_text(
        "pairs:\n  - name: smollm2-135m\n    target: {source: packaged:smollm2-135m-instruct, params: "
        "134515008, num_layers: 30, num_kv_heads: 3, head_dim: 64, hidden_size: 576, vocab_size: 49152}\n"
        "    drafter: prompt-lookup\n    context_length: 8192\n"
        f"  - name: far\n    target: {{server: {url}, model: {model}, kind: {kind}}}\n",
        encoding="utf-8",
    )
    return path


def test_generate_json_on_a_remote_pair_has_the_fields_of_a_local_pair(tmp_path, capsys) -> None:
    with running_server(tiny_engine()) as (_, url):
        models = _models_file(tmp_path, url)
        code = main(
            [
                "generate",
                "--models",
                str(models),
                "--pair",
                "far",
                "--prompt",
                "w7 w8 w9 w7 w8 w9",
                "--temperature",
                "0",
                "--max-new-tokens",
                "10",
                "--json",
            ]
        )
    record = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(record) == {
        "id",
        "sample",
        "text",
        "token_ids",
        "prompt_tokens",
        "finish_reason",
        "drafter",
        "seed",
        "stats",
    }
    assert tuple(record["stats"]) == JSON_STATS_FIELDS
    assert record["finish_reason"] == "length" and len(record["token_ids"]) == 10
    assert record["stats"]["new_tokens"] == 10 and record["stats"]["steps"] is not None  # specchat serve gives all


def test_generate_json_on_an_openai_kind_pair_has_null_for_what_the_server_does_not_say(tmp_path, capsys) -> None:
    with running_server(tiny_engine()) as (_, url):
        models = _models_file(tmp_path, url, kind="openai")
        code = main(
            [
                "generate",
                "--models",
                str(models),
                "--pair",
                "far",
                "--prompt",
                "w7 w8",
                "--temperature",
                "0",
                "--max-new-tokens",
                "6",
                "--json",
            ]
        )
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert code == 0 and tuple(stats) == JSON_STATS_FIELDS and stats["new_tokens"] == 6 and stats["ttft_s"] > 0


def test_generate_on_a_server_that_dies_keeps_the_partial_reply_and_exits_1(tmp_path, capsys) -> None:
    with server_process(step_s=0.3) as (proc, url):
        models = _models_file(tmp_path, url)
        import threading

        threading.Timer(2.5, proc.kill).start()
        code = main(
            [
                "generate",
                "--models",
                str(models),
                "--pair",
                "far",
                "--prompt",
                "w7 w8",
                "--max-new-tokens",
                "200",
                "--json",
            ]
        )
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert code == 1 and record["finish_reason"] == "error" and record["text"].strip()
    assert "partial reply is kept" in captured.err


def test_generate_on_an_unreachable_server_is_one_line(tmp_path, capsys) -> None:
    models = _models_file(tmp_path, f"http://127.0.0.1:{closed_port()}/v1")
    code = main(["generate", "--models", str(models), "--pair", "far", "--prompt", "hi", "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and "cannot reach http://127.0.0.1" in captured.err
    assert "Traceback" not in captured.err


def test_models_lists_remote_pairs_with_a_reachability_check(tmp_path, capsys) -> None:
    with running_server(tiny_engine()) as (_, url):
        models = _models_file(tmp_path, url)
        assert main(["models", "--models", str(models), "--device", "cpu"]) == 0
        up = capsys.readouterr().out
    head = next(row for row in up.splitlines() if row[2:].startswith("far "))
    assert head.endswith("server up") and "tiny @ http://127.0.0.1" in up and "(specchat)" in up
    down = _models_file(tmp_path, f"http://127.0.0.1:{closed_port()}/v1")
    assert main(["models", "--models", str(down), "--device", "cpu", "--pair", "far"]) == 0
    text = capsys.readouterr().out
    assert "server DOWN" in text and "problem   ConnectError" in text


def test_bench_on_a_remote_pair(tmp_path, capsys) -> None:
    with running_server(SlowEngine(tiny_engine())) as (_, url):
        models = _models_file(tmp_path, url)
        code = main(
            [
                "bench",
                "--models",
                str(models),
                "--pair",
                "far",
                "--suite",
                "code-edit",
                "--limit",
                "1",
                "--max-new-tokens",
                "8",
                "--modes",
                "server",
                "prompt-lookup",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert code == 0
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = bench["rows"]
    assert {r["mode"] for r in rows} == {"server", "prompt-lookup"} and all(r["new_tokens"] == 8 for r in rows)
    assert all(r["engine_stats"]["ttft_s"] is not None for r in rows)
    capsys.readouterr()
    for mode in ("hf-plain", "hf-prompt-lookup"):
        assert main(["bench", "--models", str(models), "--pair", "far", "--modes", mode]) == 2
        assert f"mode '{mode}' runs transformers in this process" in capsys.readouterr().err
    openai = _models_file(tmp_path, url, kind="vllm")
    assert main(["bench", "--models", str(openai), "--pair", "far", "--modes", "plain"]) == 2
    assert "speculates as it was started" in capsys.readouterr().err


def test_serve_refuses_a_remote_pair_and_a_bad_port(tmp_path, capsys) -> None:
    models = _models_file(tmp_path, "http://127.0.0.1:9/v1")
    assert main(["serve", "--models", str(models), "--pair", "far"]) == 2
    assert "is a remote pair" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "70000"])
