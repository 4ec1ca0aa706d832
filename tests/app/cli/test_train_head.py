"""`specchat train-head`: bad input is refused with one line naming it, before any model loads; a tiny run on the
embedded default goes end to end (slow) and resumes."""

from __future__ import annotations

import json

import pytest

from specchat.app.cli.main import main


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def _prompts(path, count=3):
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Name a colour, {i}."}]} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--prompts", "MISSING"], "does not exist"),
        (["--prompts", "PROMPTS", "--lr", "5"], "--lr 5"),
        (["--prompts", "PROMPTS", "--temperature", "99"], "temperature"),
        (["--prompts", "PROMPTS", "--max-minutes", "0"], "--max-minutes"),
        (["--prompts", "ONE"], "at least 2 prompts"),
        (["--prompts", "PROMPTS", "--pair", "nope"], "nope"),
        (["--prompts", "PROMPTS", "--out", "EARLIER"], "--resume"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, words):
    prompts, one = _prompts(tmp_path / "p.jsonl"), _prompts(tmp_path / "one.jsonl", count=1)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "replies.jsonl").write_text("{}\n")
    names = {
        "PROMPTS": str(prompts),
        "ONE": str(one),
        "MISSING": str(tmp_path / "missing.jsonl"),
        "EARLIER": str(earlier),
    }
    code = main(["train-head", *[names.get(a, a) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specchat: error:") and words in err and "Traceback" not in err


@pytest.mark.slow
def test_a_tiny_run_on_the_embedded_default_ends_with_a_head_and_a_report(tmp_path, capsys):
    prompts = _prompts(tmp_path / "p.jsonl", count=3)
    out = tmp_path / "run"
    base = ["train-head", "--prompts", str(prompts), "--out", str(out), "--batch", "1", "--max-new-tokens", "12"]
    assert main([*base, "--steps", "2", "--draft-vocab", "256", "--max-minutes", "0.0001"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stopped_at"] == 1 and not (out / "head").exists()
    assert main([*base, "--steps", "2", "--draft-vocab", "256", "--resume"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "resuming from step 1" in captured.err and "replies: 2 of 2" not in captured.err  # nothing generated again
    config = json.loads((out / "head" / "config.json").read_text())
    assert config["draft_vocab_size"] <= 256 and config["target_num_hidden_layers"] == 30
    assert report["prompts"] == 1 and report["head_bytes"] > 0 and report["steps"] == 2
