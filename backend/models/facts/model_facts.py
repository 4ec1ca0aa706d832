"""What a model's own files say about it: sizes, tensor types and bytes, context length, chat template.

Contract:

- :func:`facts_from_gguf(path)` reads a GGUF's header and tensor table (no weight is read): sizes from the
  architecture's metadata (``gguf_arch.config_from_gguf`` for the mapped families, the standard ``{arch}.*`` keys
  for the others), ``params`` the sum of the tensors' elements, ``weight_bytes`` the sum of their stored bytes and
  ``weight_types`` those bytes per type (``{"Q4_K": ..., "Q6_K": ..., "F32": ...}``).
- :func:`facts_from_folder(folder)` reads ``config.json`` (a multimodal checkpoint's ``text_config``) and the
  safetensors headers beside it (8 bytes and a JSON header per file): ``params`` from the tensors' shapes,
  ``weight_bytes`` / ``weight_types`` from their dtypes x shapes. Without safetensors (not downloaded yet, or
  pickle weights) ``params`` is computed from config.json's sizes (``params_exact`` False) and ``weight_bytes`` is
  model.safetensors.index.json's ``total_size``, or 0 (unknown).
- Both return :class:`ModelFacts` with ``where`` naming the file read; both raise :class:`FactsError` (a
  ``ValueError``) naming the file and what is wrong with it.

Only the standard library and numpy (through ``gguf_file``) are used: reading facts at start imports no torch.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIZE_FIELDS = ("params", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
_SAFETENSORS_BYTES.update({"F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8})
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


class FactsError(ValueError):
    """A model file cannot tell its sizes (the message names the file and the problem)."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int  # the longest context the model was trained for (0: not stated)
    tie_word_embeddings: bool
    architecture: str  # transformers model_type (GGUF: the mapped family, else general.architecture)
    weight_bytes: int  # the weights as stored (0: unknown, e.g. not downloaded)
    weight_types: dict[str, int] = field(default_factory=dict)  # stored type -> bytes
    chat_template: bool = False  # the file carries a chat template
    where: str = ""  # the file the facts were read from
    params_exact: bool = True  # False: computed from config.json's sizes (no weights here to count)

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SIZE_FIELDS}


def facts_from_gguf(path: str | Path) -> ModelFacts:
    """See the module docstring."""
    from specchat.backend.models.gguf.gguf_arch import GgufArchError, config_from_gguf, unsupported
    from specchat.backend.models.gguf.gguf_file import GgufFormatError, read_gguf

    path = Path(path)
    try:
        file = read_gguf(path)
    except (GgufFormatError, OSError) as error:
        raise FactsError(f"{path}: cannot read this GGUF file ({error})") from None
    metadata = file.metadata
    shapes = {name: tensor.shape for name, tensor in file.tensors.items()}
    arch = file.architecture
    try:
        if unsupported(metadata) is None:
            config = config_from_gguf(metadata, shapes)  # rope_freqs (a rope, not a size) is not read here
        else:
            config = _generic_config(metadata, arch, shapes)
    except (GgufArchError, TypeError, ValueError, ArithmeticError) as error:
        raise FactsError(f"{path}: {error}") from None
    _check_sizes(path, config, "its GGUF metadata")
    kinds: Counter[str] = Counter()
    params = 0
    for name, tensor in file.tensors.items():
        if name.startswith(("rope_freqs", "rope_factors")):
            continue
        kinds[tensor.type_name] += int(tensor.raw.nbytes)
        count = 1
        for dim in tensor.shape:
            count *= int(dim)
        params += count
    return ModelFacts(
        params=params,
        num_layers=int(config["num_hidden_layers"]),
        num_kv_heads=int(config["num_key_value_heads"]),
        head_dim=int(config["head_dim"]),
        hidden_size=int(config["hidden_size"]),
        vocab_size=int(config["vocab_size"]),
        context_length=int(config.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(config["tie_word_embeddings"]),
        architecture=str(config.get("model_type", arch)),
        weight_bytes=sum(kinds.values()),
        weight_types=dict(kinds),
        chat_template=bool(metadata.get("tokenizer.chat_template")),
        where=str(path),
    )


_SIZE_KEYS = {  # ModelFacts' name -> config.json's
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "hidden_size": "hidden_size",
    "vocab_size": "vocab_size",
}


def _check_sizes(path: Path, config: dict[str, Any], source: str) -> None:
    """FactsError naming the file and the field when a stated size is not a real model's (limits.py)."""
    from specchat.backend.limits import model_size_problem

    for name, key in _SIZE_KEYS.items():
        if key in config and (problem := model_size_problem(name, config[key])):
            raise FactsError(f"{path}: {source} says {problem}; the file is damaged or not a model: use another file")


def _generic_config(metadata: dict[str, Any], arch: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Sizes from the ``{arch}.*`` keys every llama.cpp architecture writes (for families without a row)."""

    def number(key: str, default: int | None = None) -> int:
        value = metadata.get(f"{arch}.{key}", default)
        if isinstance(value, list) and value:
            value = max(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise FactsError(f"metadata {arch}.{key} = {value!r}: expected a whole number")
        return value

    embed = shapes.get("token_embd.weight")
    hidden = number("embedding_length")
    heads = number("attention.head_count")
    return {
        "model_type": arch,
        "num_hidden_layers": number("block_count"),
        "num_key_value_heads": number("attention.head_count_kv", heads),
        "head_dim": number("attention.key_length", hidden // max(heads, 1)),
        "hidden_size": hidden,
        "vocab_size": int(embed[0]) if embed else number("vocab_size"),
        "max_position_embeddings": number("context_length", 0),
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise FactsError(f"{path}: cannot read it ({error})") from None
    if not isinstance(data, dict):
        raise FactsError(f"{path}: expected a JSON object")
    return data


def _safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            size = path.stat().st_size
            (length,) = struct.unpack("<Q", handle.read(8))
            if not 2 <= length <= min(size - 8, _MAX_HEADER):
                raise ValueError(f"header length {length} in a {size}-byte file")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise FactsError(f"{path}: not a readable safetensors file ({error}); download or copy it again") from None
    if not isinstance(header, dict):
        raise FactsError(f"{path}: the safetensors header is not a JSON object")
    return header


def _params_from_config(text: dict[str, Any], heads: int, head_dim: int, kv_heads: int) -> int:
    """A decoder's parameter count from its sizes (used only when no weights are at hand to count)."""
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    inter, vocab = int(text.get("intermediate_size") or 4 * hidden), int(text["vocab_size"])
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    tied = bool(text.get("tie_word_embeddings", False))
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def facts_from_folder(folder: str | Path) -> ModelFacts:
    """See the module docstring."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FactsError(f"{folder}: no config.json; a checkpoint folder holds config.json beside its weights")
    config = _read_json(config_file)
    inner = config.get("text_config")
    text: dict[str, Any] = {k: v for k, v in config.items() if k != "text_config"}
    if isinstance(inner, dict):  # a multimodal checkpoint: the language model's sizes
        text.update(inner)
    try:
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        kv_heads = int(text.get("num_key_value_heads") or heads)
        layers, vocab = int(text["num_hidden_layers"]), int(text["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise FactsError(f"{config_file}: no usable {error} (hidden_size, num_attention_heads, ...)") from None
    sizes = {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    _check_sizes(config_file, {**sizes, "head_dim": head_dim, "hidden_size": hidden, "vocab_size": vocab}, "it")
    kinds: Counter[str] = Counter()
    params = 0
    for file in sorted(folder.glob("*.safetensors")):
        for name, entry in _safetensors_header(file).items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            count = 1
            for dim in entry.get("shape", []):
                count *= int(dim)
            params += count
            dtype = str(entry.get("dtype"))
            kinds[dtype] += count * _SAFETENSORS_BYTES.get(dtype, 2)
    exact = params > 0
    if not exact:
        params = _params_from_config(text, heads, head_dim, kv_heads)
        index = folder / "model.safetensors.index.json"
        total = _read_json(index).get("metadata", {}).get("total_size") if index.is_file() else None
        if isinstance(total, int) and total > 0:  # the weights' bytes, before they are downloaded
            kinds["safetensors"] = total
    template = bool((folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file())
    tokenizer_config = folder / "tokenizer_config.json"
    if not template and tokenizer_config.is_file():
        template = bool(_read_json(tokenizer_config).get("chat_template"))
    return ModelFacts(
        params=params,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        context_length=int(text.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        architecture=str(text.get("model_type") or config.get("model_type") or ""),
        weight_bytes=sum(kinds.values()),
        weight_types=dict(kinds),
        chat_template=template,
        where=str(config_file),
        params_exact=exact,
    )
