"""A GGUF of a mapped architecture as a transformers model: the file's own configuration and de-quantised weights.

Why: transformers' GGUF loader drops what its tables do not name (Llama 3.x's ``rope_freqs`` scaling, gemma's
``query_pre_attn_scalar`` rule and local rope base, qwen3's head size) and so computes another model than the file's.
For the architectures of ``gguf_arch.ARCHS`` the conversion (``convert.py``) uses this module instead; the tokenizer
still comes from transformers' GGUF tokenizer.

Contract:

- :func:`mapped_config(gguf_path)`: the transformers config (``PretrainedConfig``) read by
  ``gguf_tensors.config_of``, or None when the file's architecture has no row (transformers' loader is used then).
- :func:`mapped_model(gguf_path, config)`: a float32 model of ``config`` holding the file's weights de-quantised
  (``gguf_tensors.hf_state_dict``: llama's q/k rows un-permuted, gemma's norms less one), tied where the file has no
  ``output`` tensor. Raises ``GgufArchError`` / ``GgufFormatError`` (``ValueError``) for a file that is not a
  complete model of its architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAPPING_VERSION = 1  # part of the conversion cache's folder names: a change to the mapping converts again


def mapped_config(gguf_path: str | Path) -> Any:
    """See the module docstring."""
    from transformers import AutoConfig

    from specchat.backend.models.gguf.gguf_arch import unsupported
    from specchat.backend.models.gguf.gguf_file import read_gguf
    from specchat.backend.models.gguf.gguf_tensors import config_of

    file = read_gguf(gguf_path)
    if unsupported(file.metadata) is not None:
        return None
    return AutoConfig.for_model(**config_of(file))


def mapped_model(gguf_path: str | Path, config: Any) -> Any:
    """See the module docstring."""
    import torch
    from transformers import AutoModelForCausalLM

    from specchat.backend.models.gguf.gguf_file import read_gguf
    from specchat.backend.models.gguf.gguf_tensors import hf_state_dict

    file = read_gguf(gguf_path)
    state = hf_state_dict(file, config.to_dict())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        from specchat.backend.models.gguf.gguf_arch import GgufArchError

        raise GgufArchError(f"{gguf_path}: the model lacks {missing[:3]} / does not expect {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
