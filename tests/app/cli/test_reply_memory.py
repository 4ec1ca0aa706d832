"""The suffix drafter's memory of earlier replies, from the user's side: seeded from the local history by
`specchat generate` and the chat UI's engine factory, left empty by ``--no-history`` and by the "earlier replies"
setting, bounded by the history's newest replies. The reply never depends on it (only its speed does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from foundation_fixtures import save_tiny_llama, word_tokenizer
from tiny_models import one_thread  # noqa: F401  (one_thread: autouse)

from specchat.app.chat.history.store import ChatStore
from specchat.app.chat.settings import Settings, load_settings, save_settings, settings_path
from specchat.app.cli import chat
from specchat.app.cli.main import main
from specchat.app.cli.wiring import seed_reply_memory

WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("models") / "tiny"
    return folder, save_tiny_llama(folder, word_tokenizer(WORDS), len(WORDS) + 4)


@pytest.fixture
def models_file(tmp_path, tiny_dir) -> Path:
    folder, model = tiny_dir
    config = model.config
    target = {
        "source": str(folder),
        "dtype": "float32",
        "params": sum(p.numel() for p in model.parameters()),
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    file = tmp_path / "models.yaml"
    file.write_text(
        yaml.safe_dump({"pairs": [{"name": "tiny", "target": target, "drafter": "suffix", "context_length": 256}]})
    )
    return file


def generate(capsys, models_file: Path, *extra: str) -> dict:
    code = main(
        [
            "generate",
            "--models",
            str(models_file),
            "--pair",
            "tiny",
            "--prompt",
            "w1 w2 w3 w4",
            "--temperature",
            "1",
            "--seed",
            "5",
            "--gamma",
            "8",
            "--max-new-tokens",
            "40",
            "--json",
            *extra,
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    return json.loads(out)


def remember_in_history(text: str) -> None:
    with ChatStore() as store:
        chat_id = store.create_chat("earlier", "tiny")
        store.add_message(chat_id, "user", "w1 w2 w3 w4")
        store.add_message(chat_id, "assistant", text)


def test_generate_drafts_from_earlier_replies_unless_told_not_to(capsys, models_file):
    plain = generate(capsys, models_file, "--drafter", "none")
    alone = generate(capsys, models_file, "--drafter", "suffix")  # no history yet: the conversation only
    remember_in_history(plain["text"])
    seeded = generate(capsys, models_file, "--drafter", "suffix")
    off = generate(capsys, models_file, "--drafter", "suffix", "--no-history")
    assert plain["token_ids"] == alone["token_ids"] == seeded["token_ids"] == off["token_ids"]
    assert seeded["stats"]["accepted"] >= len(plain["token_ids"]) // 2  # the earlier reply is drafted
    assert alone["stats"]["accepted"] < len(plain["token_ids"]) // 4  # a sampled reply repeats itself little
    assert off["stats"]["accepted"] == alone["stats"]["accepted"] < seeded["stats"]["accepted"]
    save_settings(Settings(draft_from_history=False), settings_path())  # the setting: the same as the flag
    assert generate(capsys, models_file, "--drafter", "suffix")["stats"]["accepted"] == off["stats"]["accepted"]


def test_generate_never_creates_a_history(capsys, models_file, isolated_dirs):
    generate(capsys, models_file, "--drafter", "suffix")
    assert not list(isolated_dirs.rglob("history.sqlite3"))


def test_recent_replies_are_the_newest_within_the_bound_oldest_first(isolated_dirs):
    with ChatStore() as store:
        for n in range(5):
            chat_id = store.create_chat(f"c{n}", "tiny")
            store.add_message(chat_id, "user", "question " * 50)
            store.add_message(chat_id, "assistant", f"reply {n} " + "x" * 100)
        store.add_message(chat_id, "assistant", "")  # an empty (cancelled) reply is skipped
        assert [r.split()[1] for r in store.recent_replies(250)] == ["2", "3", "4"]
        assert len(store.recent_replies(10**9)) == 5


class Recorder:
    def __init__(self):
        self.calls = []

    def use_reply_memory(self, enabled, replies=()):
        self.calls.append((enabled, list(replies)))
        return 0


def test_the_chat_ui_seeds_each_loaded_pair_unless_history_is_off(monkeypatch):
    """The factory the UI gets reads the history at each load (the app is running: the store is open)."""
    engine = Recorder()
    built = []

    class LoadsOnePair:
        def __init__(self, pairs, **kwargs):
            self.kwargs, self.loading_pair = kwargs, None
            built.append(kwargs)

        def run(self):
            seed_reply_memory(engine, self.kwargs["engine_factory"], lambda message, fraction: None)
            save_settings(Settings(draft_from_history=False), settings_path())
            seed_reply_memory(engine, self.kwargs["engine_factory"], lambda message, fraction: None)
            save_settings(Settings(), settings_path())
            return 0

    monkeypatch.setattr(chat, "default_engine_factory", lambda device, replies=None: replies)
    monkeypatch.setattr(chat, "SpecchatApp", LoadsOnePair)
    remember_in_history("w5 w6 w7")
    assert main([]) == 0
    assert engine.calls == [(True, ["w5 w6 w7"]), (False, [])]  # seeded; then the setting turned it off
    assert main(["--no-history"]) == 0
    assert engine.calls[2:] == [(False, []), (False, [])]
    assert built[1]["store"] is None and "History is off (--no-history)" in built[1]["startup_notices"][0]


def test_a_bad_earlier_replies_setting_is_named_and_defaults_on(isolated_dirs):
    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"draft_from_history": "yes"}))
    settings, warning = load_settings(path)
    assert settings.draft_from_history is True
    assert "draft_from_history" in warning and "'yes'" in warning
