"""`specchat add` at its edges (issue 47, class 6): everything is checked before the user's models.yaml is
written (a bad --device, an empty folder, absurd GGUF metadata); errors name the user's file and the pair, never
the trial copy ``.add-*.yaml``; a FIFO, a symlink to a device or a folder named x.gguf is called what it is; a
name a packaged pair has is refused unless --replace."""

from __future__ import annotations

import os
import re

import pytest
from gguf_files import absurd_gguf
from gguf_fixtures import gguf_pair

from specchat.app.cli.main import main
from specchat.backend.models.catalog.config import load_pairs, user_models_file

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gguf_pair("qwen2", "Q8_0", tmp_path_factory.mktemp("add"))[1]


def _add(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["add", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and ".add-" not in out + err, out + err
    assert not CONTROL.search((out + err).replace("\n", "")), repr(out + err)
    return code, out, err


def _refused(capsys, *argv: str) -> str:
    code, out, err = _add(capsys, *argv)
    assert code == 2 and "Added pair" not in out, out + err
    assert not user_models_file().exists(), "the user's file was written"
    return err


@pytest.mark.parametrize("device", ["cuda:99", "cu\x1b[31mda", "tpu", "cpu\n"])
def test_a_bad_device_is_refused_before_writing(capsys, tiny, device) -> None:
    err = _refused(capsys, str(tiny), "--device", device)
    assert "--device" in err


def test_an_empty_folder_or_one_without_a_checkpoint_is_refused(capsys, tmp_path, tiny) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is empty" in _refused(capsys, str(empty))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("hi", encoding="utf-8")
    assert "lacks config.json and weights" in _refused(capsys, str(notes))
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "m.gguf").symlink_to(tiny)
    assert "add the .gguf file itself" in _refused(capsys, str(holder))


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: os.mkfifo(p), "is a named pipe (FIFO)"),
        (lambda p: p.symlink_to("/dev/null"), "is a symlink to a character device"),
        (lambda p: p.mkdir(), "is a folder"),
        (lambda p: p.symlink_to(p.parent / "gone"), "is a broken symlink"),
        (lambda p: None, "does not exist"),
    ],
)
def test_a_path_that_is_not_a_gguf_file_is_called_what_it_is(capsys, tmp_path, make, said) -> None:
    path = tmp_path / "x.gguf"
    make(path)
    assert said in _refused(capsys, str(path))


def test_errors_name_the_users_file_and_the_pair_not_the_trial_copy(capsys, tmp_path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 40)
    err = _refused(capsys, str(broken), "--name", "mine")
    assert "adding pair 'mine'" in err and str(user_models_file()) in err


@pytest.mark.parametrize(
    "sizes",
    [
        {"block_count": 2**32 - 1},
        {"head_count": 0, "head_count_kv": 0},
        {"head_count_kv": 0},
        {"embedding_length": 2**31},
    ],
)
def test_absurd_gguf_metadata_is_refused_at_add(capsys, tmp_path, sizes) -> None:
    err = _refused(capsys, str(absurd_gguf(tmp_path / "absurd.gguf", **sizes)))
    assert "is not a real model's" in err or "absurd.gguf" in err, err


def test_a_packaged_pairs_name_needs_replace(capsys) -> None:
    err = _refused(capsys, "packaged:smollm2-135m-instruct", "--name", "smollm2-135m")
    assert "--replace" in err and "models.yaml" in err
    code, out, _ = _add(
        capsys, "packaged:smollm2-135m-instruct", "--name", "smollm2-135m", "--replace", "--device", "cpu"
    )
    assert code == 0 and "replaces the pair of that name" in out
    assert load_pairs()["smollm2-135m"].source_file == str(user_models_file())
