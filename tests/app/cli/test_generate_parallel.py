"""`specchat generate --prompts FILE --parallel N`: the replies decoded together are the ones decoded one at a time
(greedy and sampled, every sample), printed in the file's order."""

from __future__ import annotations

import json

import pytest
from engine_fixtures import tiny_engine
from tiny_models import one_thread  # noqa: F401  (one_thread: autouse)

from specchat.app.cli.main import main
from specchat.backend.engine import engine as engine_module


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def _run(monkeypatch, capsys, path, *argv: str) -> list[dict]:
    engine = tiny_engine("llama", drafter="prompt-lookup")
    engine.eos_ids = frozenset()  # a random tiny model says EOS often: every reply runs to its limit
    monkeypatch.setattr(engine_module, "load_engine", lambda pair, **kw: engine)
    code = main(["generate", "--prompts", str(path), "--json", "--max-new-tokens", "12", *argv])
    out, _ = capsys.readouterr()
    assert code == 0
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize(
    "sampling", [["--temperature", "0"], ["--temperature", "0.8", "--seed", "5", "--samples", "2"]]
)
def test_parallel_replies_equal_one_at_a_time(sampling, monkeypatch, capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {
            "id": f"p{i}",
            "messages": [{"role": "user", "content": " ".join(f"w{10 + (i * j) % 20}" for j in range(4 + i))}],
        }
        for i in range(5)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    alone = _run(monkeypatch, capsys, path, *sampling)
    together = _run(monkeypatch, capsys, path, "--parallel", "3", *sampling)
    assert [(r["id"], r["sample"], r["token_ids"]) for r in together] == [
        (r["id"], r["sample"], r["token_ids"]) for r in alone
    ]
    assert len(together) == 5 * (2 if "--samples" in sampling else 1)
