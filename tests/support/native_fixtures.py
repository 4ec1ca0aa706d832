"""The native model in tests: the library built once per session (tests/conftest.py points its cache at one
folder for the whole run), and tiny models of each family loaded for it.

``native_ready`` (a fixture) makes the library usable or skips when this machine cannot build it at all (no
compiler); a build that fails where a compiler exists fails the test. ``tiny_native(family, dtype=...)`` returns
``(transformers model, NativeCausalLM, cache)``: a tiny random model of ``family`` (tiny_models.py), saved as
safetensors and loaded by the native loader, bound to a fresh paged cache of ``dtype``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny

from specchat.backend.kernels import native, native_build
from specchat.backend.kv.kv_cache import PagedKVCache
from specchat.backend.models.loading.native_loading import NativeCausalLM, from_safetensors


@pytest.fixture
def native_ready() -> None:
    why = native_build.unavailable()
    if why is not None:
        pytest.skip(f"the native library cannot be built here: {why}")
    assert native.ensure() is None, native.reason()


def tiny_native(
    family: str, folder: Path, *, dtype: torch.dtype = torch.float32, max_tokens: int = 256, **overrides
) -> tuple[torch.nn.Module, NativeCausalLM, PagedKVCache]:
    model = build_tiny(family, **overrides)
    model.save_pretrained(folder)
    loaded = from_safetensors(folder, model.config)
    cache = PagedKVCache.for_model(model.config, max_tokens=max_tokens, block_size=16, dtype=dtype, device="cpu")
    loaded.native.bind(cache)
    return model, loaded, cache


def run(loaded: NativeCausalLM, seq, ids, keep: int | None = None, parents=None, taps=()):
    """One native pass over ``ids`` after ``seq``'s committed tokens (not committed): (logits, taps)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return loaded.native.forward(seq, ids, keep or ids.numel(), parents, taps)


def one_by_one(loaded: NativeCausalLM, seq, ids) -> torch.Tensor:
    """Logits of one-token passes over ``ids`` after ``seq``'s committed tokens, each committed after it, then
    rolled back (what a row of a longer pass must equal, bit for bit)."""
    start, rows = seq.length, []
    for token in ids:
        rows.append(run(loaded, seq, [token])[0])
        seq.commit(1)
    seq.truncate(start)
    return torch.cat(rows)


def tiny_native_loaded(folder: Path):
    """A tiny random llama checkpoint saved under ``folder`` and loaded for the native model, as the engine loads
    one (the embedded default's spec, float32 on the CPU, eos id 2)."""
    from engine_fixtures import tiny_tokenizer

    from specchat.backend.models.catalog.config import load_pairs
    from specchat.backend.models.loading.pair import LoadedModel

    model = build_tiny("llama")
    model.save_pretrained(folder / "target")
    return LoadedModel(
        model=from_safetensors(folder / "target", model.config),
        tokenizer=tiny_tokenizer(),
        spec=load_pairs()["smollm2-135m"].target,
        device=torch.device("cpu"),
        dtype=torch.float32,
        generation_config={"eos_token_id": 2},
    )
