"""A model from its source alone: sizes, stored types and bytes read from a GGUF, a checkpoint folder or the HF cache
(``model_facts.py``, ``spec_facts.py``, ``model_spec.py``), overrides checked against them, and the memory estimate
built on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_fixtures import gguf_pair
from tiny_models import build_tiny, one_thread  # noqa: F401  (a fixture)

from specchat.backend.errors import ConfigError
from specchat.backend.models.catalog.config import load_pairs_file
from specchat.backend.models.facts import memory
from specchat.backend.models.facts.model_facts import facts_from_folder, facts_from_gguf
from specchat.backend.models.gguf.gguf_file import read_gguf

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def qwen3_q4k(tmp_path_factory) -> tuple[object, Path]:
    return gguf_pair("qwen3", "Q4_K", tmp_path_factory.mktemp("q4k"))


def _yaml(tmp_path: Path, target: str, extra: str = "") -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(f"pairs:\n  - name: p\n    target:\n{target}{extra}", encoding="utf-8")
    return path


def test_a_gguf_source_alone_is_enough(tmp_path, qwen3_q4k):
    model, gguf = qwen3_q4k
    pair = load_pairs_file(_yaml(tmp_path, f"      source: {gguf}\n"))["p"]
    spec = pair.target
    config = model.config
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.hidden_size, spec.vocab_size) == (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        config.hidden_size,
        config.vocab_size,
    )
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert set(dict(spec.origins).values()) == {"file"} and spec.facts_file == str(gguf)
    file = read_gguf(gguf)
    assert spec.weight_bytes == sum(t.raw.nbytes for t in file.tensors.values())
    assert set(dict(spec.weight_types)) == {"Q4_K", "F32"} and spec.architecture == "qwen3"
    assert spec.context_max == config.max_position_embeddings and spec.chat_template
    assert pair.context_length == 8192 and pair.drafter == "prompt-lookup"


def test_overrides_are_checked_against_the_file(tmp_path, qwen3_q4k):
    _, gguf = qwen3_q4k
    agreeing = load_pairs_file(_yaml(tmp_path, f"      source: {gguf}\n      num_layers: 2\n"))["p"].target
    assert agreeing.origin("num_layers") == "override" and agreeing.origin("params") == "file"
    with pytest.raises(ConfigError) as info:
        load_pairs_file(_yaml(tmp_path, f"      source: {gguf}\n      num_kv_heads: 8\n"))
    message = str(info.value)
    for part in ("'target.num_kv_heads'", "= 8", "says 2", str(gguf), "remove the field"):
        assert part in message, message


def test_context_beyond_the_models_is_refused(tmp_path, qwen3_q4k):
    _, gguf = qwen3_q4k
    with pytest.raises(ConfigError, match=r"longest context of 16384 tokens"):
        load_pairs_file(_yaml(tmp_path, f"      source: {gguf}\n", "    context_length: 32768\n"))


def test_a_damaged_gguf_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ConfigError) as info:
        load_pairs_file(_yaml(tmp_path, f"      source: {bad}\n"))
    assert str(bad) in str(info.value) and "download it again" in str(info.value)


def test_a_checkpoint_folder_counts_its_safetensors(tmp_path):
    model = build_tiny("qwen2")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    facts = facts_from_folder(tmp_path / "ckpt")
    assert facts.params == sum(p.numel() for p in model.parameters()) and facts.params_exact
    assert facts.weight_bytes == 2 * facts.params and facts.weight_types == {"BF16": 2 * facts.params}
    assert (facts.num_layers, facts.num_kv_heads, facts.vocab_size) == (2, 2, 128)
    pair = load_pairs_file(_yaml(tmp_path, f"      source: {tmp_path / 'ckpt'}\n"))["p"]
    assert pair.target.params == facts.params and pair.context_length == 512  # the model states 512


def _fake_cache(root: Path, repo: str, files: dict[str, Path | bytes]) -> Path:
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("c0ffee")
    for name, content in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.read_bytes() if isinstance(content, Path) else content)
    return snapshot


def test_hub_sources_read_from_the_cache_only(tmp_path, qwen3_q4k):
    model = build_tiny("llama")
    model.save_pretrained(tmp_path / "src")
    _fake_cache(tmp_path / "hf", "org/tiny", {"config.json": tmp_path / "src" / "config.json"})
    spec = load_pairs_file(_yaml(tmp_path, "      source: org/tiny\n"))["p"].target
    assert spec.num_layers == 2 and spec.origin("num_layers") == "file"
    assert spec.params == sum(p.numel() for p in model.parameters())  # computed from config.json's sizes
    _, gguf = qwen3_q4k
    source = "hf:org/tiny-GGUF/sub/tiny-q4_k.gguf"
    unknown = load_pairs_file(_yaml(tmp_path, f"      source: {source}\n"))["p"].target
    assert unknown.kind == "hub-gguf" and not unknown.sizes_known
    assert (unknown.hub_repo, unknown.hub_filename) == ("org/tiny-GGUF", "sub/tiny-q4_k.gguf")
    _fake_cache(tmp_path / "hf", "org/tiny-GGUF", {"sub/tiny-q4_k.gguf": gguf})
    known = load_pairs_file(_yaml(tmp_path, f"      source: {source}\n"))["p"].target
    assert known.sizes_known and known.weight_bytes == facts_from_gguf(gguf).weight_bytes


def test_bad_hub_file_sources_say_the_form(tmp_path):
    for source in ("hf:org/name", "hf:org/name/file.bin", "hf:org--x/name/f.gguf"):
        with pytest.raises(ConfigError, match="hf:ORG/NAME/FILE.gguf"):
            load_pairs_file(_yaml(tmp_path, f"      source: {source}\n"))


def test_memory_uses_the_files_numbers_and_waits_for_unknown_sizes(tmp_path, qwen3_q4k, monkeypatch):
    _, gguf = qwen3_q4k
    pair = load_pairs_file(_yaml(tmp_path, f"      source: {gguf}\n"))["p"]
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")  # transformers' path (the native one: test_memory_native.py)
    estimate = memory.estimate_pair(pair, CPU)
    assert estimate.known and estimate.target_weights == pair.target.params * 4  # de-quantised to float32
    monkeypatch.setattr(memory, "as_stored", lambda spec, device: True)  # a loader that keeps the file's blocks
    assert memory.estimate_pair(pair, CPU).target_weights == pair.target.weight_bytes
    unknown = load_pairs_file(_yaml(tmp_path, "      source: org/not-cached\n"))["p"]
    monkeypatch.setattr(memory, "free_memory", lambda device: 1)
    assert not memory.check_fits(unknown, CPU).known  # not refused: checked again once its files are here
