"""models.yaml's ``head:`` (drafter eagle3 / medusa / auto): sources, fields, and errors that name them."""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.backend.errors import ConfigError
from specchat.backend.models.catalog.config import load_pairs, load_pairs_file

TARGET = "      source: org/target-model\n" + "".join(
    f"      {k}: {v}\n" for k, v in dict(params=1000, num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=64,
                                        vocab_size=300).items()
)  # fmt: skip


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))


def pair_yaml(name: str = "p1", *, extra: str = "", drafter: str = "prompt-lookup") -> str:
    return (
        f"  - name: {name}\n    description: a test pair\n    target:\n{TARGET}"
        f"    drafter: {drafter}\n    context_length: 2048\n{extra}"
    )


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text("pairs:\n" + body, encoding="utf-8")
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_pairs_file(path)
    return str(info.value)


def test_a_head_from_the_hub_a_folder_or_the_package(tmp_path):
    (tmp_path / "myhead").mkdir()
    body = (
        pair_yaml("hub", drafter="eagle3", extra="    head: org/eagle3-head\n")
        + pair_yaml("dir", drafter="medusa", extra="    head: {source: ./myhead}\n")
        + pair_yaml("auto", drafter="auto", extra="    head: {source: org/h, revision: v1, allow_pickle: true}\n")
    )
    pairs = load_pairs_file(write(tmp_path, body))
    assert pairs["hub"].head is not None and pairs["hub"].head.kind == "hub"
    assert pairs["dir"].head is not None and pairs["dir"].head.path == str((tmp_path / "myhead").resolve())
    head = pairs["auto"].head
    assert head is not None and (head.revision, head.allow_pickle, pairs["auto"].drafter) == ("v1", True, "auto")


def test_the_packaged_head_ships_with_its_own_pair_and_the_default_stays_without_it():
    pairs = load_pairs()
    pair = pairs["smollm2-135m-eagle3"]
    assert pair.drafter == "auto" and pair.head is not None and pair.head.source == "packaged:smollm2-135m-eagle3"
    folder = pair.head.packaged_folder()
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    # Not the default's drafter until a head pays on chat (it is slower there today: the head's README).
    assert pairs["smollm2-135m"].head is None and pairs["smollm2-135m"].drafter == "prompt-lookup"


@pytest.mark.parametrize(
    ("drafter", "extra", "field", "words"),
    [
        ("eagle3", "", "head", "no head is given"),
        ("prompt-lookup", "    head: org/h\n", "head", "drafter is prompt-lookup"),
        ("eagle3", "    head: ./nowhere\n", "head.source", "does not exist"),
        ("eagle3", "    head: packaged:nope\n", "head.source", "no packaged head"),
        ("eagle3", "    head: {source: org/h, colour: red}\n", "head.colour", "unknown field"),
        ("eagle3", "    head: {source: org/h, allow_pickle: 1}\n", "head.allow_pickle", "true or false"),
        ("eagle3", "    head: {source: org/h, revision: 'a b'}\n", "head.revision", "branch, tag or commit"),
        ("eagle3", "    head: [org/h]\n", "head", "a source or a mapping"),
    ],
)
def test_bad_heads_are_named(tmp_path, drafter, extra, field, words):
    message = error_of(write(tmp_path, pair_yaml(drafter=drafter, extra=extra)))
    assert f"field '{field}'" in message and words in message and "pair 'p1'" in message
