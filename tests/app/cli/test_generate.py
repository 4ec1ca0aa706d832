"""`specchat generate --json` reports what plain decoding would have, whatever the drafter (issue 14).

The engine is a tiny one (tests/support/engine_fixtures.py) put in place of the pair's load; its prompt-lookup
drafter is scripted to propose the rest of the plain reply, so whole runs of tokens past a stop string are
accepted in one step.
"""

from __future__ import annotations

import json

import pytest
from engine_fixtures import tiny_engine
from tiny_models import one_thread  # noqa: F401  (one_thread: autouse)

from specchat.app.cli.main import main
from specchat.backend.engine import engine as engine_module
from specchat.backend.speculative.drafters.base import Draft, StatelessHooks

PROMPT = " ".join(f"w{i}" for i in range(10, 30))


class PerfectDrafter(StatelessHooks):
    """Proposes the continuation of a known reply (the plain decoding's)."""

    name = "prompt-lookup"

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.start = reply, 0

    def configure(self, rule, reply_start: int) -> None:
        self.start = reply_start

    def propose(self, context, max_tokens):
        return Draft(token_ids=self.reply[len(context) - self.start :][:max_tokens])


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def generate(monkeypatch, capsys, *argv: str, reply: list[int] | None = None) -> dict:
    engine = tiny_engine("llama", drafter="prompt-lookup")
    if reply is not None:
        engine.drafters["prompt-lookup"] = PerfectDrafter(reply)
    monkeypatch.setattr(engine_module, "load_engine", lambda pair, **kw: engine)
    code = main(["generate", "--prompt", PROMPT, "--json", "--temperature", "0", "--max-new-tokens", "30", *argv])
    out, _ = capsys.readouterr()
    assert code == 0
    (record,) = [json.loads(line) for line in out.splitlines()]
    return record


def test_a_stop_string_inside_a_speculative_step_reports_plain_decodings_tokens(monkeypatch, capsys):
    full = generate(monkeypatch, capsys, "--drafter", "none")
    words = full["text"].split()
    assert len(words) > 10 and isinstance(full["seed"], int)
    for stop in (words[3], f"{words[6]} {words[7]}"):
        plain = generate(monkeypatch, capsys, "--drafter", "none", "--stop", stop)
        drafted = generate(
            monkeypatch, capsys, "--drafter", "prompt-lookup", "--gamma", "8", "--stop", stop, reply=full["token_ids"]
        )
        assert plain["finish_reason"] == drafted["finish_reason"] == "stop"
        assert plain["text"] == drafted["text"] and not plain["text"].rstrip().endswith(stop)
        assert plain["token_ids"] == drafted["token_ids"] and len(plain["token_ids"]) < len(full["token_ids"])
        assert plain["stats"]["new_tokens"] == drafted["stats"]["new_tokens"] == len(plain["token_ids"])
        assert drafted["stats"]["accepted"] > 0


def test_a_prediction_file_keeps_the_reply_and_json_reports_its_usage_counts(monkeypatch, capsys, tmp_path):
    """Issue 35: --prediction-file drafts from the file; the reply is plain decoding's; --json carries OpenAI's
    accepted/rejected prediction counts (null without a prediction)."""
    plain = generate(monkeypatch, capsys, "--drafter", "none")
    assert plain["stats"]["accepted_prediction_tokens"] is None and plain["stats"]["rejected_prediction_tokens"] is None
    predicted = tmp_path / "predicted.txt"
    predicted.write_text(plain["text"].strip(), encoding="utf-8")
    got = generate(monkeypatch, capsys, "--drafter", "none", "--prediction-file", str(predicted))
    assert got["token_ids"] == plain["token_ids"] and got["text"] == plain["text"]
    stats = got["stats"]
    assert stats["accepted_prediction_tokens"] > 0 and stats["rejected_prediction_tokens"] == 0
    assert stats["drafted"] == stats["accepted_prediction_tokens"] and got["drafter"] == "prediction"


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), (b"\xff\xfe bad", "is not UTF-8 text")],
)
def test_a_bad_prediction_file_is_named_before_anything_loads(monkeypatch, capsys, tmp_path, content, message):
    path = tmp_path / "p.txt"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setattr(engine_module, "load_engine", lambda pair, **kw: pytest.fail("loaded a model"))
    code = main(["generate", "--prompt", "hi", "--prediction-file", str(path)])
    _, err = capsys.readouterr()
    assert code != 0 and f"--prediction-file {path}" in err and message in err


def test_a_prediction_file_for_a_server_that_takes_none_is_refused_by_name(monkeypatch, capsys, tmp_path):
    """A remote pair of kind vllm (no Predicted Outputs) is refused before any request; kinds openai and specchat
    send it (backend/remote/client.py)."""
    from serve_fixtures import remote_pair

    remote_pair(tmp_path, "http://127.0.0.1:9/v1", kind="vllm", name="far")
    predicted = tmp_path / "p.txt"
    predicted.write_text("hello", encoding="utf-8")
    code = main(["generate", "--models", str(tmp_path / "far.yaml"), "--pair", "far", "--prompt", "hi",
                 "--prediction-file", str(predicted)])  # fmt: skip
    _, err = capsys.readouterr()
    assert code != 0 and "pair 'far' runs on a vllm server, which takes no prediction" in err
