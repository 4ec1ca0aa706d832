"""A byte-level BPE tokenizer over tests/support/tiny_models.py's 128 ids: the printable ASCII characters, a few merged
tokens (so a text has several tokenizations, as with real models) and ``<pad>`` / ``<s>`` / ``</s>``: what the
constraint tests need to write JSON with the tiny random-weight models. Two chat templates: a plain ChatML-like one
and a Qwen2.5-style one that defines tools (``<tool_call>{...}</tool_call>``)."""

from __future__ import annotations

from tiny_models import VOCAB_SIZE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<s>", "</s>")
_BYTE_SPACE, _BYTE_NEWLINE = "\u0120", "\u010a"  # byte-level BPE's spellings of " " and "\n"
MERGES = [('{', '"'), ('"', ':'), (':', _BYTE_SPACE), (',', _BYTE_SPACE), ('"', ','), ('"', '}'), ('t', 'r'),
          ('tr', 'u'), ('tru', 'e'), ('n', 'a'), ('m', 'e'), ('na', 'me'), ('a', 'g'), ('ag', 'e'), ('1', '0'),
          ('"', ']'), ('[', '"'), ('n', 'u'), ('nu', 'l'), ('nul', 'l'), ('f', 'a'), ('fa', 'l'), ('fal', 's'),
          ('fals', 'e')]  # fmt: skip

CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
QWEN_TOOLS = (
    "{% if tools %}<s>system\n<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>"
    "<tool_call></s>\n{% endif %}"  # short: the tiny model's context is 512 characters
    "{% for m in messages %}{% if m['role'] == 'tool' %}<s>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response></s>\n{% elif m.get('tool_calls') %}<s>assistant\n{% for c in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}</s>\n{% else %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def char_tokenizer(template: str = CHATML) -> PreTrainedTokenizerFast:
    alphabet = [chr(c) for c in range(33, 127)] + [_BYTE_SPACE, _BYTE_NEWLINE]
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for token in alphabet + ["".join(pair) for pair in MERGES]:
        vocab.setdefault(token, len(vocab))
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": []})
    fast.chat_template = template
    return fast


def char_engine(drafter: str = "prompt-lookup", gamma="auto", draft: bool = False, template: str = CHATML):
    """A tiny random-weight llama (and, with ``draft``, a draft model of another seed) over :func:`char_tokenizer`."""
    import dataclasses

    from engine_fixtures import tiny_loaded, tiny_pair

    from specchat.backend.engine.engine import Engine

    tokenizer = char_tokenizer(template)
    target = dataclasses.replace(tiny_loaded("llama"), tokenizer=tokenizer)
    twin = dataclasses.replace(tiny_loaded("llama", seed=1), tokenizer=tokenizer) if draft else None
    pair = tiny_pair(drafter="draft-model" if draft else drafter, gamma=gamma, context_length=512)
    return Engine(target, twin, pair)
