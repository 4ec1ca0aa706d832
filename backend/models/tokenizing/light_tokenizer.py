"""A tokenizer read with the ``tokenizers`` library alone, for folders this app converted itself.

Why: transformers' ``AutoTokenizer`` imports transformers, whose lazy-import scan of its model files costs seconds of
every start (``benchmarks/RESULTS.md``, "Start time and memory"); the int4 / int8 default (``skeleton.LightCausalLM``)
needs nothing else from it. A folder that ``convert.py`` wrote from a GGUF holds ``tokenizer.json`` (the fast
tokenizer transformers saved), ``tokenizer_config.json`` and the chat template; this class reads them and does what
the engine asks of a tokenizer the way transformers' ``TokenizersBackend`` (transformers 5) does it:

- ``tok(text, add_special_tokens=True)["input_ids"]`` and ``encode``: the backend's ``encode``, whose
  post-processor adds the special tokens, as transformers' fast tokenizer calls it;
- ``decode(ids, skip_special_tokens=...)``: the backend's ``decode`` (transformers skips its clean-up of
  spaces for BPE models, the only kind :func:`eligible` accepts);
- ``apply_chat_template(messages, add_generation_prompt=..., tokenize=..., return_dict=...)``: the template
  rendered in a Jinja sandbox configured as transformers configures it (trim and lstrip blocks, loop controls,
  its ``tojson``, ``raise_exception``, ``strftime_now``), given the messages, ``tools``/``documents`` None, the
  generation flag and the named special tokens; the text is then encoded without special tokens (a dict with
  ``input_ids`` unless ``return_dict=False``, as transformers 5 returns);
- ``len(tok)``, ``get_vocab()``, ``token_to_id(token)`` (one entry of it), ``bos/eos/pad/unk_token(_id)``,
  ``chat_template``.

Only plain chat messages (role and content strings) are rendered: anything else (a template call with
other arguments, messages with other fields) is refused with a clear error rather than rendered
differently. ``tests/backend/models/test_light_tokenizer.py`` compares every method with transformers'
tokenizer of the same folder, on the embedded model and on tiny tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id"}  # what backend/tool_calls.py passes on
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The tokenizer classes whose saved tokenizer.json is all there is to them (no Python-side pre-processing).
_CLASSES = (
    "TokenizersBackend",
    "PreTrainedTokenizerFast",
    "GPT2Tokenizer",
    "GPT2TokenizerFast",
    "Qwen2Tokenizer",
    "Qwen2TokenizerFast",
    "LlamaTokenizerFast",
)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token's text as tokenizer_config.json stores it: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def eligible(folder: Path) -> bool:
    """Whether the folder's tokenizer_config.json names a tokenizer this class reproduces: a saved fast tokenizer of
    a known class, without the spaces clean-up or options that change encoding in Python. (:func:`load` also
    checks that the model is BPE.)"""
    return _reproducible_config(folder) is not None


def _reproducible_config(folder: Path) -> dict | None:
    """The folder's tokenizer_config.json when :func:`eligible` holds, else None."""
    config = _read_json(folder / "tokenizer_config.json")
    if config is None or not (folder / "tokenizer.json").is_file():
        return None
    if config.get("tokenizer_class") not in _CLASSES or config.get("clean_up_tokenization_spaces"):
        return None
    # Options transformers applies in Python around the backend (prefix spaces, legacy SentencePiece handling,
    # forced BOS/EOS): leave such folders to transformers.
    if any(
        config.get(key)
        for key in (
            "add_prefix_space",
            "legacy",
            "add_bos_token",
            "add_eos_token",
            "split_special_tokens",
            "do_lower_case",
        )
    ):
        return None
    return config


def load(folder: Path) -> LightTokenizer | None:
    """The folder's tokenizer, or None where this class would not reproduce transformers' (not :func:`eligible`,
    or a model other than BPE). A damaged tokenizer.json raises what ``tokenizers`` raises."""
    config = _reproducible_config(folder)
    if config is None:
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if type(backend.model).__name__ != "BPE":
        return None
    special = {name: text for name in SPECIAL if (text := _token_text(config.get(name))) is not None}
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
    if template is None and isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    if template:
        import jinja2

        try:
            _compiled(template)
        except jinja2.TemplateSyntaxError:  # e.g. transformers' own {% generation %} tag: its renderer decides
            return None
    return LightTokenizer(backend, special, template)


class LightTokenizer:
    """See the module docstring. Build with :func:`load`."""

    def __init__(self, backend: Any, special: dict[str, str], chat_template: str | None) -> None:
        self._backend = backend
        self._special = special  # named special tokens present: name -> text
        self.chat_template = chat_template
        for name in SPECIAL:
            text = special.get(name)
            setattr(self, name, text)
            setattr(self, f"{name}_id", None if text is None else backend.token_to_id(text))

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers`` library's tokenizer (transformers' fast tokenizers' name for it): what a grammar
        engine reads the vocabulary from (backend/speculative/constraint.py)."""
        return self._backend

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """One entry of :meth:`get_vocab` without building the whole dict (added tokens included)."""
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(
            [ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens
        )

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        tools: list[dict] | None = None,
    ) -> dict[str, list[int]] | list[int] | str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        plain = []
        for i, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or not {"role", "content"} <= set(message) <= _MESSAGE_KEYS
                or not isinstance(message["role"], str)
                or not isinstance(message["content"], str)
            ):
                raise ValueError(f"message {i}: only role and content strings (and tool calls) can be rendered here")
            plain.append(dict(message))
        text = _compiled(self.chat_template).render(
            messages=plain, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self._special
        )
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(text, add_special_tokens=False)


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:  # not jinja's, which escapes HTML characters
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
