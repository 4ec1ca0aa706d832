"""Security (issue 7, part 4): no pickle is ever deserialised unless a pair opts in, no remote code unless a pair
opts in, no network at run time (HF_HUB_OFFLINE honoured; a socket guard proves nothing connects), and /edit
writes only the file the user named, with a backup, and never executes what the model wrote.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from foundation_fixtures import local_spec, save_tiny_llama, word_tokenizer
from tiny_models import one_thread  # noqa: F401  (one_thread: autouse)

from specchat.app.chat.edit_files import apply_edit
from specchat.app.chat.editing import load_edit_target
from specchat.app.cli.main import main
from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine, load_engine
from specchat.backend.errors import ModelLoadError
from specchat.backend.limits import DEFAULT_PAIR
from specchat.backend.models.catalog.config import PairConfig, load_pairs
from specchat.backend.models.loading.pair import load_model, load_pair

WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or resolve a name fails the test (and is recorded)."""
    attempts: list = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network use at run time: {args!r:.200}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return attempts


def _pair(target, draft=None) -> PairConfig:
    return PairConfig(
        name="tiny",
        description="",
        target=target,
        drafter="draft-model" if draft else "none",
        draft=draft,
        gamma="auto",
        context_length=64,
        sampling={},
        source_file="test",
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sec") / "tiny"
    return folder, save_tiny_llama(folder, word_tokenizer(WORDS), len(WORDS) + 4)


# --- pickle ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.ckpt"])
def test_pickle_only_folder_is_refused_and_never_unpickled(tmp_path, tiny_dir, monkeypatch, name):
    folder = tmp_path / "m"
    folder.mkdir()
    for file in tiny_dir[0].iterdir():
        if file.suffix != ".safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    torch.save(tiny_dir[1].state_dict(), folder / name)
    unpickled = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a) or real_load(*a, **k))
    with pytest.raises(ModelLoadError) as info:
        load_pair(_pair(local_spec(folder, tiny_dir[1])), "cpu")
    text = str(info.value)
    assert name in text and "allow_pickle: true" in text and "arbitrary code" in text and "safetensors" in text
    assert unpickled == []
    opted_in = dataclasses.replace(local_spec(folder, tiny_dir[1]), allow_pickle=True)
    if name == "pytorch_model.bin":
        assert load_model(opted_in, "cpu").model is not None  # opting in loads it
    else:  # transformers reads pickles only under its own file names: still a clear error, never a traceback
        with pytest.raises(ModelLoadError, match="cannot load"):
            load_model(opted_in, "cpu")


def test_safetensors_preferred_even_when_pickle_sits_beside_it(tmp_path, tiny_dir, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    for file in tiny_dir[0].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    load_model(dataclasses.replace(local_spec(folder, tiny_dir[1]), allow_pickle=True), "cpu")


# --- remote code -------------------------------------------------------------------------------------------


def _record_from_pretrained(monkeypatch) -> list[tuple[str, object]]:
    calls: list[tuple[str, object]] = []
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig, transformers.AutoModelForCausalLM):
        real = cls.from_pretrained.__func__

        def wrapper(klass, *args, _real=real, _name=cls.__name__, **kwargs):
            calls.append((_name, kwargs.get("trust_remote_code", "not passed")))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(wrapper))
    return calls


@pytest.mark.parametrize("opt_in", [False, True])
def test_trust_remote_code_only_when_the_pair_opts_in(tiny_dir, monkeypatch, opt_in):
    calls = _record_from_pretrained(monkeypatch)
    spec = dataclasses.replace(local_spec(*tiny_dir), trust_remote_code=opt_in)
    load_pair(_pair(spec, spec), "cpu")
    names = {name for name, _ in calls}
    assert {"AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"} <= names
    assert all(value is opt_in for _, value in calls), calls


def test_shipped_pairs_never_opt_into_pickle_or_remote_code():
    for pair in load_pairs().values():
        for spec in (pair.target, pair.draft):
            if spec is not None:
                assert not spec.allow_pickle and not spec.trust_remote_code, pair.name


# --- no network at run time --------------------------------------------------------------------------------


def test_local_pair_loads_and_generates_with_the_network_cut(tiny_dir, no_network, tmp_path, capsys):
    spec = local_spec(*tiny_dir)
    engine = load_engine(_pair(spec, spec), device="cpu")
    events = list(
        engine.generate(
            GenerationRequest(
                messages=[{"role": "user", "content": "w1 w2 w3"}],
                sampling=SamplingParams(temperature=0, max_new_tokens=4),
            )
        )
    )
    assert events[-1].finish_reason in ("length", "eos")
    assert gc.get_freeze_count() > 0  # load_engine froze the loaded heap (engine.settle_heap)
    # The same through `specchat generate`.
    config = tiny_dir[1].config
    block = {
        "source": str(tiny_dir[0]),
        "dtype": "float32",
        "params": sum(p.numel() for p in tiny_dir[1].parameters()),
        "num_layers": 2,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": True,
    }
    file = tmp_path / "models.yaml"
    file.write_text(
        yaml.safe_dump({"pairs": [{"name": "tiny", "target": block, "drafter": "prompt-lookup", "context_length": 64}]})
    )
    code = main(
        [
            "generate",
            "--models",
            str(file),
            "--pair",
            "tiny",
            "--prompt",
            "w1 w2 w1 w2",
            "--json",
            "--max-new-tokens",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["finish_reason"] in ("length", "eos")
    assert no_network == []


_CALLER_CACHE = os.environ.get("SPECCHAT_CACHE_DIR")


@pytest.mark.slow
def test_embedded_default_loads_from_the_cache_and_generates_offline(no_network, monkeypatch):
    if _CALLER_CACHE:
        monkeypatch.setenv("SPECCHAT_CACHE_DIR", _CALLER_CACHE)
    else:
        monkeypatch.delenv("SPECCHAT_CACHE_DIR", raising=False)
    engine = load_engine(load_pairs()[DEFAULT_PAIR], device="cpu")
    assert isinstance(engine, Engine)
    events = list(
        engine.generate(
            GenerationRequest(
                messages=[{"role": "user", "content": "Say hello."}],
                sampling=SamplingParams(temperature=0, max_new_tokens=8),
            )
        )
    )
    assert "".join(e.text for e in events).strip() and no_network == []


# --- /edit -------------------------------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def test_edit_writes_only_the_named_file_and_never_runs_the_reply(tmp_path):
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    target = project / "pkg" / "calc.py"
    target.write_text("def add(a, b):\n    return a + b\n")
    (project / "pkg" / "other.py").write_text("x = 1\n")
    (project / "README").write_text("readme\n")
    (project / "link.py").symlink_to(project / "pkg" / "other.py")
    before = _tree(project)
    marker = tmp_path / "pwned"
    reply = (
        f"import os\nos.system('touch {marker}')\n__import__('subprocess').run(['touch', '{marker}'])\n"
        "```sh\nrm -rf ~\n```\n"
    )
    backup = apply_edit(load_edit_target(target), reply)
    after = _tree(project)
    changed = {k for k in after if before.get(k) != after[k]}
    assert changed == {"pkg/calc.py"}  # the copy of the original lives in the edit's journal, not in the project
    assert not backup.is_relative_to(project)
    assert target.read_text() == reply and backup.read_text() == "def add(a, b):\n    return a + b\n"
    assert not marker.exists()
