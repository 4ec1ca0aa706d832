"""The GGUF conversion cache heals (backend/models/gguf/convert.py, loading.py's retry): a damaged cache folder is
noticed and made again on the next start, a full disk or an unwritable cache is named as such, a crafted
hashes.json cannot steer a path, abandoned temporary folders go away, and kill -9 at any moment of a
conversion or a load leaves a cache the next start uses without asking anyone."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from foundation_fixtures import write_tiny_gguf

from specchat.backend.errors import ModelLoadError
from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.gguf import cache_keys, convert
from specchat.backend.models.loading import pair as loading
from specchat.backend.models.loading.pair import load_model


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def _spec(gguf: Path, quantization: str = "none"):
    base = load_pairs()["smollm2-135m-f32"].target
    return dataclasses.replace(base, source=str(gguf), kind="gguf", path=str(gguf), quantization=quantization)


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Counts conversions (float32 and metadata-only)."""
    seen: list[Path] = []
    for name in ("_convert_into", "_convert_metadata"):
        real = getattr(convert, name)

        def counted(gguf_path, folder, progress, _real=real):
            seen.append(folder)
            return _real(gguf_path, folder, progress)

        monkeypatch.setattr(convert, name, counted)
    return seen


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))  # same size: only the header check notices
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "missing"])
@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_damaged_cache_file_is_converted_again(tmp_path, conversions, how, name):
    """Fails on the old cache (a marker file was all it checked): 'download or copy the model again', or a
    request for sentencepiece when tokenizer.json was gone."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = load_model(_spec(gguf), "cpu")
    assert len(conversions) == 1
    ids = torch.tensor([first.tokenizer("the the he")["input_ids"]])
    expected = first.model(ids).logits
    _damage(first.path / name, how)
    again = load_model(_spec(gguf), "cpu")
    assert len(conversions) == 2 and again.path == first.path and convert.is_complete(again.path)
    torch.testing.assert_close(again.model(ids).logits, expected)


@pytest.mark.parametrize("how", ["truncated", "garbage", "missing"])
def test_the_int4_paths_metadata_heals_too(tmp_path, conversions, how):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", weights="Q4_1", embedding="Q8_0")
    first = load_model(_spec(gguf, "int4-torch"), "cpu")
    assert first.path.name.split("-transformers-")[0].endswith("-meta") and len(conversions) == 1
    assert not (first.path / convert.WEIGHTS).exists()  # weights are read from the GGUF itself
    _damage(first.path / "generation_config.json", how)
    again = load_model(_spec(gguf, "int4-torch"), "cpu")
    assert len(conversions) == 2 and convert.is_complete(again.path)


def test_damage_only_loading_notices_is_healed_once(tmp_path, conversions, monkeypatch):
    """A file with the recorded size and a valid header but unreadable content: the loader's failure
    invalidates the folder and converts once more; a second failure is reported, not looped on."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = load_model(_spec(gguf), "cpu")
    config = first.path / "config.json"
    config.write_text("{" + " " * (config.stat().st_size - 2) + "x")  # same size, not JSON
    assert convert.is_complete(first.path)
    load_model(_spec(gguf), "cpu")
    assert len(conversions) == 2
    monkeypatch.setattr(
        loading,
        "_load_tokenizer_from",
        lambda folder, spec, light_model: (_ for _ in ()).throw(loading.CacheDamage(f"{folder}: still unreadable")),
    )
    with pytest.raises(ModelLoadError, match="still unreadable"):
        load_model(_spec(gguf), "cpu")
    assert len(conversions) == 3  # one retry, then the error


def test_a_full_disk_is_named_not_the_gguf(tmp_path, monkeypatch):
    """Fails on the old code, which blamed the packaged GGUF ('download it again')."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")

    def no_space(gguf_path, folder, progress):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    monkeypatch.setattr(convert, "_convert_into", no_space)
    with pytest.raises(ModelLoadError) as caught:
        convert.ensure_converted(gguf)
    message = str(caught.value)
    assert "no room on the disk" in message and str(convert.cache_dir()) in message
    assert "SPECCHAT_CACHE_DIR" in message and "download it again" not in message
    assert list((convert.cache_dir() / "converted").iterdir()) == []  # the partial folder is gone


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    real = convert.shutil.disk_usage
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    monkeypatch.setattr(convert, "_convert_into", lambda *a: pytest.fail("started converting"))
    with pytest.raises(ModelLoadError, match="no room on the disk holding the model cache"):
        convert.ensure_converted(gguf)


def test_an_unwritable_cache_is_named(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(blocked))
    with pytest.raises(ModelLoadError, match=r"cannot (use|write) the (model|hash) cache") as caught:
        convert.ensure_converted(gguf)
    assert "SPECCHAT_CACHE_DIR" in str(caught.value)


@pytest.mark.parametrize("crafted", ["../../../escaped", "/tmp/absolute", "0" * 63 + "/", "A" * 64, 42])
def test_a_crafted_digest_never_becomes_a_path(tmp_path, crafted):
    """Fails on the old code: hashes.json's value was used as given, and '../..' wrote outside the cache."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    stat = gguf.stat()
    store = cache_keys._hash_cache_file()
    store.parent.mkdir(parents=True, exist_ok=True)
    key = next(iter(_hash_key(gguf, stat)))
    store.write_text(json.dumps({key: crafted}))
    folder = convert.converted_dir(gguf)
    assert folder.parent == convert.cache_dir() / "converted"
    assert cache_keys.file_sha256(gguf) == _sha256(gguf)


def _hash_key(gguf: Path, stat) -> set[str]:
    """hashes.json's key for ``gguf``: learnt by letting file_sha256 write it once."""
    cache_keys.file_sha256(gguf)
    keys = set(json.loads(cache_keys._hash_cache_file().read_text()))
    return keys


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_dead_writers_temporary_folder_is_removed(tmp_path):
    """A lock no process holds (its writer was killed) marks the folder as abandoned, whatever its name says;
    a live writer's folder stays."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    parent = convert.cache_dir() / "converted"
    parent.mkdir(parents=True)
    abandoned = parent / f".tmp-x-pid{os.getpid()}-abc"  # a reused pid: the name alone would keep it
    abandoned.mkdir()
    (abandoned / convert.LOCK).write_text("")
    (abandoned / "model.safetensors").write_bytes(b"\0" * 1000)
    live = parent / ".tmp-y-pid1-def"
    live.mkdir()
    fd = convert._hold_lock(live)
    try:
        convert.ensure_converted(gguf)
        assert not abandoned.exists() and live.exists()
    finally:
        os.close(fd)
    convert.remove_stale_temporaries(parent)
    assert not live.exists()


# --- kill -9 at random moments ------------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys, dataclasses
    from pathlib import Path
    from specchat.backend.models.catalog.config import load_pairs
    from specchat.backend.models.loading.pair import load_model
    gguf, quantization = Path(sys.argv[1]), sys.argv[2]
    base = load_pairs()["smollm2-135m-f32"].target
    spec = dataclasses.replace(base, source=str(gguf), kind="gguf", path=str(gguf), quantization=quantization)
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(1000):  # convert (first time), then load again and again until killed
        load_model(spec, "cpu")
""")


def _kill_runs(tmp_path: Path, runs: int, seed: int) -> None:
    rng = random.Random(seed)
    ggufs = {
        q: write_tiny_gguf(tmp_path / f"tiny-{q}.gguf", weights="Q4_1" if q != "none" else "F32")
        for q in ("none", "int4-torch")
    }
    for run in range(runs):
        quantization = rng.choice(sorted(ggufs))
        gguf = ggufs[quantization]
        if rng.random() < 0.7:  # mostly kill during a first conversion
            for folder in (convert.cache_dir() / "converted").glob(f"{gguf.stem}-*"):
                convert.invalidate(folder)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(gguf), quantization],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("\n")
        child.stdin.flush()
        time.sleep(rng.uniform(0.0, 2.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        loaded = load_model(_spec(gguf, quantization), "cpu")  # the next start recovers, nobody asked
        assert convert.is_complete(loaded.path), run
        ids = torch.tensor([loaded.tokenizer("the he")["input_ids"]])
        with torch.inference_mode():
            assert torch.isfinite(loaded.model(ids).logits).all()
        leftovers = [p for p in (convert.cache_dir() / "converted").iterdir() if p.name.startswith(".tmp-")]
        assert leftovers == [], (run, leftovers)


@pytest.mark.slow
def test_kill_9_during_conversion_or_load_recovers(tmp_path):
    _kill_runs(tmp_path, 10, seed=16)


@pytest.mark.soak
def test_kill_9_soak(tmp_path):
    _kill_runs(tmp_path, 100, seed=1616)


def test_a_first_start_parses_the_gguf_metadata_once(tmp_path, monkeypatch) -> None:
    """The tokenizer and the configuration share one parse of the file's metadata (the legacy GGUF reader
    took 6-8 s per parse of the embedded file's vocabulary, twice per first start); what they build is the
    same as with two parses."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    real = gguf_utils.load_gguf_checkpoint
    calls: list[bool] = []

    def counted(path, return_tensors=False, *args, **kwargs):
        calls.append(return_tensors)
        return real(path, return_tensors, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    tokenizer, config = convert._gguf_tokenizer_and_config(gguf, None)
    assert calls.count(False) == 1 and gguf_utils.load_gguf_checkpoint is counted  # restored after the block
    separate_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    separate_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert calls.count(False) == 3  # without the block, transformers parses again (else this test shows nothing)
    assert config.to_dict() == separate_config.to_dict()
    text = "the tiny the"
    assert tokenizer(text)["input_ids"] == separate_tokenizer(text)["input_ids"]
    assert tokenizer.get_vocab() == separate_tokenizer.get_vocab()
