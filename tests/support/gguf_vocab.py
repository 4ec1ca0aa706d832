"""A tiny byte-level BPE vocabulary and each family's chat template, for the GGUF fixtures (``gguf_fixtures.py``).

Contract: :data:`TOKENS` is the vocabulary as a GGUF stores it (``tokenizer.ggml.tokens``: the 256 bytes spelled
in GPT-2's byte alphabet, :data:`MERGES`' results, then :data:`SPECIALS`), ``TOKEN_TYPES`` their types (1 normal,
3 control), :data:`VOCAB_SIZE` its length. :data:`FAMILY_CHAT` gives, per family, the chat template (short Jinja
templates in each family's format: Llama 3 headers, Mistral's [INST], ChatML, Gemma's turns, Phi-3's tags) and the
bos / eos / end-of-turn tokens llama.cpp's converter would record; ``None`` as template is a base model.
"""

from __future__ import annotations

from typing import Any


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the order of byte values)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


BYTES = _byte_alphabet()
_SPACE = BYTES[ord(" ")]  # "Ġ"
_NEWLINE = BYTES[ord("\n")]  # "Ċ"
MERGES: tuple[str, ...] = tuple(
    f"{a} {b}"
    for a, b in (
        (_SPACE, "t"),
        ("h", "e"),
        ("i", "n"),
        ("e", "r"),
        ("a", "n"),
        ("o", "n"),
        ("r", "e"),
        (_SPACE, "a"),
        ("e", "n"),
        (_SPACE, "s"),
        ("o", "r"),
        ("e", "s"),
        (_SPACE, "w"),
        ("a", "t"),
        ("i", "s"),
        ("e", "d"),
        ("i", "t"),
        (_SPACE, "c"),
        ("a", "r"),
        (_SPACE, "o"),
        (_SPACE, "f"),
        ("o", "u"),
        ("l", "e"),
        (_SPACE, "b"),
        (_SPACE, "p"),
        ("a", "l"),
        (_NEWLINE, _NEWLINE),
        (_SPACE, _SPACE),
        ("d", "e"),
        ("r", "o"),
        (_SPACE, "m"),
        ("i", "c"),
    )
)
SPECIALS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<pad>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|system|>",
    "<unk>",
)
TOKENS: list[str] = BYTES + ["".join(m.split(" ")) for m in MERGES] + list(SPECIALS)
TOKEN_TYPES: list[int] = [1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS)
VOCAB_SIZE = len(TOKENS)
ID = {token: index for index, token in enumerate(TOKENS)}

_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% else %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
)
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# family -> template (None: a base model), bos, eos, end of turn (None: eos ends the turn)
FAMILY_CHAT: dict[str, dict[str, Any]] = {
    "llama": {"template": _LLAMA3, "bos": "<|begin_of_text|>", "eos": "<|endoftext|>", "eot": "<|eot_id|>"},
    "mistral": {"template": _MISTRAL, "bos": "<bos>", "eos": "<eos>", "eot": None},
    "qwen2": {"template": _CHATML, "bos": "<|endoftext|>", "eos": "<|im_end|>", "eot": None},
    "qwen3": {"template": _CHATML, "bos": "<|endoftext|>", "eos": "<|im_end|>", "eot": None},
    "gemma2": {"template": _GEMMA, "bos": "<bos>", "eos": "<eos>", "eot": "<end_of_turn>"},
    "gemma3": {"template": _GEMMA, "bos": "<bos>", "eos": "<eos>", "eot": "<end_of_turn>"},
    "phi3": {"template": _PHI3, "bos": "<|endoftext|>", "eos": "<|endoftext|>", "eot": "<|end|>"},
    "base": {"template": None, "bos": "<|endoftext|>", "eos": "<|endoftext|>", "eot": None},
}


def tokenizer_metadata(family: str) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata llama.cpp's converter writes for this vocabulary in ``family``'s format."""
    chat = FAMILY_CHAT[family]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2" if family.startswith("qwen") else "default",
        "tokenizer.ggml.bos_token_id": ID[chat["bos"]],
        "tokenizer.ggml.eos_token_id": ID[chat["eos"]],
        "tokenizer.ggml.padding_token_id": ID["<pad>"],
        "tokenizer.ggml.unknown_token_id": ID["<unk>"],
        "tokenizer.ggml.add_bos_token": family in ("llama", "mistral", "gemma2", "gemma3"),
    }
    if chat["eot"] is not None:
        meta["tokenizer.ggml.eot_token_id"] = ID[chat["eot"]]
    if chat["template"] is not None:
        meta["tokenizer.chat_template"] = chat["template"]
    return meta
