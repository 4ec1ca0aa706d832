"""The seven families' GGUF files through the path that runs them today (``quantization: none``: converted once
with the file's own configuration and weights, ``gguf_to_hf.py``, then run by transformers): from ``source:``
alone, greedy identical to transformers over the same de-quantised weights; the chat template rendered as
transformers renders it; the reply stops at the family's end of turn; a base model says it runs as plain
completion. (The native fast path gets its own identity tests where its loader lands.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_fixtures import FAMILIES, build_source, gguf_pair, reference_model, write_gguf
from gguf_vocab import FAMILY_CHAT, ID
from tiny_models import one_thread  # noqa: F401  (a fixture)

from specchat.backend.models.catalog.config import load_pairs_file
from specchat.backend.models.loading import pair as loading
from specchat.backend.models.tokenizing.chat_format import PLAIN_COMPLETION, plain_completion_note, stop_ids
from specchat.backend.models.tokenizing.light_tokenizer import _compiled

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "the cat sat"},
    {"role": "assistant", "content": "on the mat"},
    {"role": "user", "content": "and then?"},
]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))


def _load(tmp_path: Path, gguf: Path):
    yaml = tmp_path / "models.yaml"
    yaml.write_text(f"pairs:\n  - name: p\n    target: {{source: {gguf}}}\n", encoding="utf-8")
    spec = load_pairs_file(yaml)["p"].target
    return loading.load_model(spec, "cpu", attn_implementation="eager")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_over_the_same_weights(tmp_path, family: str, qtype: str) -> None:
    _, gguf = gguf_pair(family, qtype, tmp_path)
    loaded = _load(tmp_path, gguf)
    reference = reference_model(gguf)
    prompt = torch.tensor([[ID["<bos>"], 70, 101, 33, 200, 9, 150, 44, 61, 12, 250, 18]])
    with torch.no_grad():
        ours = loaded.model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        theirs = reference.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.testing.assert_close(loaded.model(prompt).logits, reference(prompt).logits, rtol=1e-4, atol=1e-4)
    assert ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_and_stops_come_from_the_file(tmp_path, family: str) -> None:
    _, gguf = gguf_pair(family, "Q8_0", tmp_path)
    loaded = _load(tmp_path, gguf)
    tokenizer = loaded.tokenizer
    chat = FAMILY_CHAT[family]
    assert tokenizer.chat_template == chat["template"]
    theirs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    special = {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token") if getattr(tokenizer, name)}
    ours = _compiled(chat["template"]).render(
        messages=MESSAGES, tools=None, documents=None, add_generation_prompt=True, **special
    )
    assert ours == theirs  # the light tokenizer's sandbox renders as transformers does
    stops = stop_ids(tokenizer, loaded.generation_config)
    assert ID[chat["eos"]] in stops
    if chat["eot"] is not None:
        assert ID[chat["eot"]] in stops  # e.g. gemma's <end_of_turn>, llama 3's <|eot_id|>
    assert plain_completion_note(tokenizer) is None


def test_a_base_model_runs_as_plain_completion(tmp_path) -> None:
    gguf = write_gguf(build_source("qwen2"), tmp_path / "base.gguf", "Q8_0", "base")
    loaded = _load(tmp_path, gguf)
    assert not loaded.tokenizer.chat_template
    assert plain_completion_note(loaded.tokenizer) == PLAIN_COMPLETION
    assert stop_ids(loaded.tokenizer, loaded.generation_config) == {ID["<|endoftext|>"]}
