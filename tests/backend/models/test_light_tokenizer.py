"""The light tokenizer (backend/models/tokenizing/light_tokenizer.py) against transformers' tokenizer of the same
folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from foundation_fixtures import save_tiny_llama, word_tokenizer, write_tiny_gguf
from transformers import AutoTokenizer, GenerationConfig

from specchat.backend.engine.prompting import render
from specchat.backend.models.catalog.config import ModelSpec
from specchat.backend.models.gguf import convert
from specchat.backend.models.loading import capture, skeleton
from specchat.backend.models.loading import pair as loading
from specchat.backend.models.loading.pair import packaged_gguf_path
from specchat.backend.models.tokenizing import light_tokenizer
from specchat.backend.models.tokenizing.light_tokenizer import LightTokenizer

TEXTS = (
    "",
    "the the",
    "def f(x):\n    return x ** 2  # square\n",
    "  \t\n\n  indented\r\n",
    "naïve café — 東京 🙂 Привет",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a<|im_end|>b<|endoftext|>",
    "trailing space ",
    "\x00\x07 control",
    "ÿþ\ufffd",
)
CHATS = (
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again, with 東京 🙂"},
    ],
    [{"role": "user", "content": "<|im_start|>x<|im_end|>"}],
)
# Jinja features chat templates use: namespaces, loop variables, filters, tojson, raise_exception, the
# special tokens, trim / lstrip of blocks.
TEMPLATE = """{% set ns = namespace(n=0) %}{{ bos_token }}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
    {% set ns.n = ns.n + 1 %}
<|im_start|>{{ m['role'] }} {{ loop.index }}/{{ messages|length }} {{ m | tojson }}
{{ m['content'] | trim }}{% if not loop.last %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant {{ ns.n }}
{% endif %}"""


def _same(light: LightTokenizer, theirs, chats=CHATS) -> None:
    assert len(light) == len(theirs)
    vocab = theirs.get_vocab()
    assert light.get_vocab() == vocab
    for token in [*list(vocab)[:50], "<|im_end|>", "<end_of_turn>", "not a token at all"]:
        assert light.token_to_id(token) == vocab.get(token), token
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(light, name) == getattr(theirs, name), name
    assert light.chat_template == theirs.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = light(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], text
            assert light.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        for i in range(1, 4):  # the detokenizer decodes short windows, single bytes of a character included
            window = light.encode(text, add_special_tokens=False)[-i:]
            assert light.decode(window, skip_special_tokens=True) == theirs.decode(window, skip_special_tokens=True)
    if light.chat_template:
        for chat in chats:
            for prompt in (True, False):
                assert light.apply_chat_template(
                    chat, add_generation_prompt=prompt, tokenize=False
                ) == theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            assert render(light, chat) == render(theirs, chat)
            assert light.apply_chat_template(chat)["input_ids"] == theirs.apply_chat_template(chat)["input_ids"]
            assert light.apply_chat_template(chat, return_dict=False) == theirs.apply_chat_template(
                chat, return_dict=False
            )


@pytest.fixture
def tiny_folder(isolated_dirs, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    return gguf, convert.ensure_converted(gguf, weights=False)


def test_a_converted_tiny_gguf_tokenizes_as_transformers_does(tiny_folder):
    _, folder = tiny_folder
    assert light_tokenizer.eligible(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    light = light_tokenizer.load(folder)
    _same(light, AutoTokenizer.from_pretrained(folder))
    assert "1/1" in light.apply_chat_template(CHATS[0], tokenize=False)


def test_a_template_that_raises_raises_the_same_way(tiny_folder):
    import jinja2

    _, folder = tiny_folder
    (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    light = light_tokenizer.load(folder)
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        light.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="message 0"):  # fields it does not render are refused, not dropped
        light.apply_chat_template([{"role": "user", "content": "x", "name": "bob"}])


def test_folders_it_does_not_reproduce_are_left_to_transformers(tiny_folder, tmp_path):
    _, folder = tiny_folder
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, value in (
        ("clean_up_tokenization_spaces", True),
        ("add_bos_token", True),
        ("tokenizer_class", "LlamaTokenizer"),
    ):
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, key: value}))
        assert not light_tokenizer.eligible(folder), key
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert light_tokenizer.eligible(folder)
    (folder / "chat_template.jinja").write_text("{% generation %}{{ messages }}{% endgeneration %}")
    assert light_tokenizer.load(folder) is None  # a tag only transformers' renderer knows
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert light_tokenizer.load(folder) is not None
    words = tmp_path / "words"  # a WordLevel model: not BPE
    save_tiny_llama(words, word_tokenizer(["a", "b"]), 16)
    assert light_tokenizer.load(words) is None
    assert not light_tokenizer.eligible(tmp_path / "missing")


def _gguf_spec(gguf, quantization: str = "int4-torch") -> ModelSpec:
    return ModelSpec(
        source=str(gguf),
        kind="gguf",
        revision=None,
        dtype="auto",
        quantization=quantization,
        params=0,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=64,
        vocab_size=262,
        download_bytes=0,
        gated=False,
        path=str(gguf),
    )


def test_an_int4_gguf_spec_loads_the_light_tokenizer_and_a_damaged_one_heals(tiny_folder, monkeypatch):
    gguf, folder = tiny_folder
    tok = loading.load_tokenizer(_gguf_spec(gguf), light_model=True)
    assert isinstance(tok, LightTokenizer)
    (folder / "tokenizer.json").write_text("{not json")  # a damaged cache converts again
    healed = loading.load_tokenizer(_gguf_spec(gguf), light_model=True)
    assert isinstance(healed, LightTokenizer) and healed.get_vocab() == tok.get_vocab()
    monkeypatch.setenv("SPECCHAT_LIGHT_TOKENIZER", "0")
    assert not isinstance(loading.load_tokenizer(_gguf_spec(gguf), light_model=True), LightTokenizer)
    monkeypatch.delenv("SPECCHAT_LIGHT_TOKENIZER")
    # transformers' model (another device or attention): transformers' tokenizer, with its whole API
    assert not isinstance(loading.load_tokenizer(_gguf_spec(gguf)), LightTokenizer)
    # transformers builds that model: its tokenizer too
    assert not isinstance(loading.load_tokenizer(_gguf_spec(gguf, "none"), light_model=True), LightTokenizer)


def test_generation_values_are_transformers_diff(tmp_path):
    for values in (
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "use_cache": True},
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1},
        {"do_sample": False, "temperature": 1.0, "max_new_tokens": 64, "eos_token_id": [2, 3]},
    ):
        GenerationConfig(**values).save_pretrained(tmp_path)
        theirs = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
        mine = skeleton.generation_values(tmp_path)
        assert {k: mine[k] for k in loading._GENERATION_KEYS if k in mine} == {
            k: theirs[k] for k in loading._GENERATION_KEYS if k in theirs
        }
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        skeleton.generation_values(tmp_path)


def test_transformers_bars_are_routed_once_it_is_imported_inside_a_block():
    from transformers.utils import logging as tf_logging

    seen = []
    with capture.capture_library_output(lambda message, fraction: seen.append(message)):
        capture.transformers_imported()
        capture.transformers_imported()  # idempotent
        bar = tf_logging.tqdm(total=2, desc="Loading weights")
        bar.update(2)
        bar.close()
    assert any("Loading weights" in m for m in seen)


@pytest.mark.slow
def test_the_embedded_models_tokenizer_is_transformers(isolated_dirs):
    folder = convert.ensure_converted(packaged_gguf_path(), weights=False)
    assert light_tokenizer.eligible(folder)
    light = light_tokenizer.load(folder)
    assert light.chat_template
    _same(light, AutoTokenizer.from_pretrained(folder))


@pytest.mark.slow
def test_the_default_starts_without_importing_transformers():
    script = (
        "import sys; from specchat.backend.engine.engine import load_engine; "
        "from specchat.backend.models.catalog.config import load_pairs; "
        "e = load_engine(load_pairs()['smollm2-135m'], device='cpu'); "
        "print(type(e.tokenizer).__name__, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "LightTokenizer False", out.stdout + out.stderr


def test_stop_ids_look_tokens_up_one_by_one():
    """The end-of-turn ids are found with token_to_id where the tokenizer has it, never by building the whole
    vocabulary dict (~38 MiB at once for a 152k-entry tokenizer, at the load's peak)."""
    from specchat.backend.models.tokenizing.chat_format import stop_ids

    class Light:
        eos_token_id = 2
        chat_template = "{{ '<|im_end|>' }} {{ '<end_of_turn>' }}"

        def token_to_id(self, token):
            return {"<|im_end|>": 7}.get(token)

        def get_vocab(self):
            raise AssertionError("the whole vocabulary was built")

    assert stop_ids(Light(), {}) == frozenset({2, 7})
