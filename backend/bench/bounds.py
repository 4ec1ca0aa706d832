"""The bandwidth bound beside each `specchat bench` figure: bytes read per token ÷ measured read bandwidth.

Decoding one token reads every weight once (batch 1), so no engine beats ``bandwidth / bytes per token``.
Contract: :func:`bandwidth_bounds(engine, llamacpp_gguf)` measures the read bandwidth once
(``synthetic.read_bandwidth``: a reduction over 256 MiB) and returns, per engine, the bytes a token reads and
the bound in tok/s: specchat's loaded target (every parameter and buffer, the input embedding excluded: a
lookup reads one row), and llama.cpp's GGUF (every tensor but ``token_embd``, unless the file has no
``output.weight`` and the head reads the embedding). K/V reads are left out (small at these lengths).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROBE_BYTES = 256 * 2**20


def _model_bytes(model) -> int:
    if hasattr(model, "bytes_per_token"):  # the CPU native model knows what a pass reads
        return int(model.bytes_per_token)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    skip = {id(t) for t in (list(embed.parameters()) + list(embed.buffers()))} if embed is not None else set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and any(id(t) in skip for t in head.parameters())
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or (id(tensor) in skip and not tied):
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def _gguf_bytes(path: Path) -> int:
    from specchat.backend.models.gguf.gguf_file import read_gguf

    tensors = read_gguf(path).tensors
    tied = "output.weight" not in tensors
    return sum(t.raw.nbytes for name, t in tensors.items() if name != "token_embd.weight" or tied)


def bandwidth_bounds(engine, llamacpp_gguf: Path | None) -> dict[str, Any]:
    """``{"read_bandwidth_GBps", "specchat": {...}, "llamacpp": {...}}`` (see the module docstring)."""
    from specchat.backend.bench.synthetic import read_bandwidth

    bandwidth = read_bandwidth(engine.target.device, PROBE_BYTES)
    result: dict[str, Any] = {"read_bandwidth_GBps": bandwidth / 1e9}
    sizes = {"specchat": _model_bytes(engine.target.model)}
    if llamacpp_gguf is not None:
        sizes["llamacpp"] = _gguf_bytes(llamacpp_gguf)
    for name, size in sizes.items():
        result[name] = {"bytes_per_token": size, "bound_tok_s": bandwidth / max(size, 1)}
    return result


def describe(bounds: dict[str, Any]) -> str:
    parts = [
        f"{name} {b['bytes_per_token'] / 1e6:.0f} MB a token → ≤ {b['bound_tok_s']:.0f} tok/s"
        for name, b in bounds.items()
        if isinstance(b, dict)
    ]
    return f"bandwidth bound (read bandwidth {bounds['read_bandwidth_GBps']:.1f} GB/s): " + "; ".join(parts)
