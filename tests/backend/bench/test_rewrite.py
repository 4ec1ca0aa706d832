"""`specchat bench`'s rewrite family and its modes (issue 35): the prompts (whole files with a small change, each
its file as prediction), the ``prediction`` mode (the same reply as plain decoding, its usage counts kept), and
the ``llama-server`` modes against a fake server (CI has no llama.cpp binary; tests/support/fake_llama_server.py):
started on the pair's GGUF with the bench's threads, sent specchat's rendered prompt with the same limits,
timed, their timings kept, stopped at the end; a binary that is missing or fails to start is named.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from engine_fixtures import tiny_engine
from rich.console import Console
from tiny_models import one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.bench import llama_server
from specchat.backend.bench.modes import LLAMA_SERVER_MODES, Mode, parse_modes
from specchat.backend.bench.runner import BenchRunner
from specchat.backend.bench.suites import REWRITE_FAMILY, BenchPrompt, load_code_edit, load_suite
from specchat.backend.errors import ConfigError, RequestError

FAKE_SERVER = Path(__file__).resolve().parents[2] / "support" / "fake_llama_server.py"


# -- the prompts ----------------------------------------------------------------------------------------------
def test_the_rewrite_family_is_whole_files_with_a_small_change_and_the_file_as_prediction():
    prompts = load_suite(REWRITE_FAMILY, None)
    assert 10 <= len(prompts) <= 14 and {p.family for p in prompts} == {REWRITE_FAMILY}
    assert {p.category for p in prompts} == {"rename", "add-parameter", "type-hints", "fix-bug", "translate-comments"}
    lines = []
    for p in prompts:
        ((role, content),) = p.messages
        fence = re.match(r"```(\w+)\n", content)
        assert role == "user" and fence and p.assistant_prefix == fence.group(0), p.id
        file_text = content[fence.end() : content.index("```\n\nApply this change")]
        assert p.prediction == file_text + "```" and p.stop == ("\n```",) and p.max_new_tokens, p.id
        lines.append(file_text.count("\n"))
    assert min(lines) >= 50 and max(lines) <= 400
    assert load_suite("all", 1) and all(p.family != REWRITE_FAMILY for p in load_suite("all", 1))


def test_every_rewrite_prompt_and_its_reply_fit_the_embedded_defaults_context():
    from specchat.backend.engine.prompting import render
    from specchat.backend.models.catalog.config import load_pairs
    from specchat.backend.models.loading.pair import load_tokenizer

    pair = load_pairs()["smollm2-135m"]
    tokenizer = load_tokenizer(pair.target)
    for p in load_suite(REWRITE_FAMILY, None):
        ids = render(tokenizer, p.message_dicts()) + tokenizer.encode(p.assistant_prefix, add_special_tokens=False)
        predicted = len(tokenizer.encode(p.prediction, add_special_tokens=False))
        assert p.max_new_tokens >= predicted and len(ids) + p.max_new_tokens + 64 <= pair.context_length, p.id


@pytest.mark.parametrize(
    ("field", "value"),
    [("prediction", 3), ("stop", "```"), ("stop", [""]), ("max_new_tokens", 0), ("assistant_prefix", ["x"])],
)
def test_a_bad_rewrite_field_is_named(tmp_path, field, value):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], field: value}) + "\n")
    with pytest.raises(ConfigError, match=f"rows.jsonl:1: '{field}' must be"):
        load_code_edit(path, REWRITE_FAMILY)


# -- modes ----------------------------------------------------------------------------------------------------
def test_rewrite_modes_by_default_and_by_name():
    names = [m.name for m in parse_modes(None, has_draft=False, pair_name="p", rewrite=True)]
    assert names == ["plain", "prompt-lookup", "suffix", "prediction"]  # llama-server not checked: left out
    names = [m.name for m in parse_modes(None, has_draft=True, pair_name="p", rewrite=True, llama_server_missing=None)]
    assert names == ["plain", "prompt-lookup", "suffix", "prediction", "draft-model", *LLAMA_SERVER_MODES]
    prediction, server, ngram, simple = parse_modes(
        ["prediction", "llama-server", "llama-server-ngram", "llama-server-ngram:ngram-simple"],
        has_draft=False,
        pair_name="p",
    )
    assert prediction == Mode("prediction", "specchat", "prompt-lookup", prediction=True)
    assert (server.runner, server.drafter, ngram.drafter, simple.drafter) == (
        "llama-server",
        "none",
        "ngram-mod",
        "ngram-simple",
    )
    for bad, message in [
        ("llama-server-ngram:ngram-fast", "n-gram types are"),
        ("llama-server:4", "takes no suffix"),
        ("prediction:4", "take a :GAMMA suffix"),
    ]:
        with pytest.raises(RequestError, match=message):
            parse_modes([bad], has_draft=False, pair_name="p")
    with pytest.raises(RequestError, match="no llama-server on PATH"):
        parse_modes(["llama-server"], has_draft=False, pair_name="p", llama_server_missing="no llama-server on PATH")
    with pytest.raises(RequestError, match="is remote"):
        parse_modes(["llama-server"], has_draft=False, pair_name="p", remote_kind="openai")


# -- the prediction mode ----------------------------------------------------------------------------------------
def test_the_prediction_mode_sends_the_prediction_and_keeps_the_plain_reply():
    engine = tiny_engine("llama", drafter="none", context_length=512)
    words = " ".join(f"w{i}" for i in random_ids(20, seed=2))
    modes = parse_modes(["plain", "prompt-lookup", "prediction"], has_draft=False, pair_name="tiny")
    runner = BenchRunner(engine, modes, max_new_tokens=8, temperature=0.0)
    base = BenchPrompt("p", REWRITE_FAMILY, "rename", (("user", words),), assistant_prefix="w50 w51")
    first = runner.run([base])
    reply = " ".join(f"w{t}" for t in first[0].token_ids if t != 2)
    prompt = BenchPrompt(
        "q",
        REWRITE_FAMILY,
        "rename",
        (("user", words),),
        prediction=reply + " w7 w8",
        assistant_prefix="w50 w51",
        max_new_tokens=40,
    )
    rows = {r.mode: r for r in runner.run([prompt])}
    assert rows["prediction"].token_ids == rows["plain"].token_ids == rows["prompt-lookup"].token_ids
    assert rows["prediction"].vs_plain == "same"
    stats = rows["prediction"].engine_stats
    assert stats.prediction_tokens == len(reply.split()) + 2 and stats.accepted_prediction_tokens is not None
    assert rows["plain"].engine_stats.accepted_prediction_tokens is None
    assert runner.prompt_ids(prompt)[-2:] == engine.tokenizer.encode("w50 w51", add_special_tokens=False)


def test_a_prompts_stop_and_token_limit_bound_its_reply():
    engine = tiny_engine("llama", drafter="none", context_length=512)
    runner = BenchRunner(engine, parse_modes(["plain"], has_draft=False, pair_name="t"), max_new_tokens=50)
    words = " ".join(f"w{i}" for i in random_ids(20, seed=6))
    (free,) = runner.run([BenchPrompt("a", "x", "c", (("user", words),), max_new_tokens=30)])
    assert len(free.token_ids) <= 30
    texts = engine.tokenizer.decode(free.token_ids[:6]).split()
    (stopped,) = runner.run([BenchPrompt("b", "x", "c", (("user", words),), max_new_tokens=30, stop=(texts[3],))])
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < len(free.token_ids)


# -- llama-server ---------------------------------------------------------------------------------------------
@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    """An executable named llama-server that runs the fake, logging to a file; returns (binary, log)."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    binary.chmod(0o755)
    log = tmp_path / "server.log"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(log))
    return binary, log


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_llama_server_modes_run_interleaved_against_a_fake_server(tmp_path, fake_binary, monkeypatch):
    from specchat.app.cli import bench as cmd_bench
    from specchat.backend.engine.prompting import render
    from specchat.backend.models.loading.pair import packaged_gguf_path

    binary, log = fake_binary
    engine = tiny_engine("llama", context_length=2048)
    args = argparse.Namespace(
        pair=None,
        suite="code-edit",
        limit=1,
        max_new_tokens=5,
        modes=["plain", "llama-server", "llama-server-ngram"],
        out=str(tmp_path / "out"),
        temperature=0.0,
        seed=0,
        models=None,
        device=None,
        synthetic=None,
        llama_server=str(binary),
        repeats=1,
    )
    out = Console(file=io.StringIO(), width=220, record=True)
    assert cmd_bench.execute(args, 1, lambda i: engine, err=Console(file=io.StringIO()), out=out) == 0
    records = _records(log)
    starts = [r for r in records if "argv" in r]
    assert len(starts) == 2  # one server per mode, both up for the whole run
    for start, spec in zip(starts, (None, "ngram-mod")):
        argv = start["argv"]
        assert argv[argv.index("-m") + 1] == str(packaged_gguf_path())
        assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == str(torch.get_num_threads())
        assert argv[argv.index("-c") + 1] == "2048" and argv[argv.index("--host") + 1] == "127.0.0.1"
        assert (argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else None) == spec
        assert start["ld_library_path"].split(os.pathsep)[0] == str(binary.parent)
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    requests = [r["request"] for r in records if "request" in r]
    measured = [q for q in requests if q["n_predict"] == 5]  # a warm-up and one measured run per mode
    assert len(measured) == 4 and all(q["cache_prompt"] is False and q["temperature"] == 0.0 for q in measured)
    rendered = render(engine.tokenizer, load_suite("code-edit", 1)[0].message_dicts())
    assert all(q["prompt"] == rendered for q in measured)  # the ids specchat rendered, as they are
    assert rows["llama-server"]["new_tokens"] == rows["llama-server-ngram"]["new_tokens"] == 5
    assert rows["llama-server-ngram"]["vs_plain"] == "same"  # checked against llama-server's own plain decoding
    assert rows["llama-server"]["ttft_s"] == pytest.approx(0.005)  # the server's prompt_ms
    assert rows["llama-server-ngram"]["engine_stats"]["acceptance_rate"] == 0.5
    aggs = {a["mode"]: a for a in data["aggregates"]}
    assert aggs["llama-server-ngram"]["acceptance_rate"] == 0.5 and aggs["llama-server"]["acceptance_rate"] is None
    with pytest.raises(OSError):  # stopped at the end: nothing listens on their ports any more
        import urllib.request

        port = starts[0]["argv"][starts[0]["argv"].index("--port") + 1]
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_llama_server_missing_or_failing_is_named(tmp_path, fake_binary, monkeypatch):
    binary, _ = fake_binary
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    reason = llama_server.unavailable(None, Path("model.gguf"))
    assert "no llama-server on PATH" in reason and "--llama-server" in reason
    assert "is not a file or a command" in llama_server.unavailable(str(tmp_path / "missing"), Path("m.gguf"))
    assert "not a GGUF" in llama_server.unavailable(str(binary), None)
    assert llama_server.unavailable(str(binary), Path("m.gguf")) is None
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "start")
    with pytest.raises(RequestError, match="exited with code 1 while starting(.|\n)*failed to load model"):
        llama_server.LlamaServer(binary, Path("m.gguf"), spec_type=None, threads=1, context_length=256)
