"""GGUF read directly into int4 / int8 layers (backend/models/gguf/gguf_file.py, quantized.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from foundation_fixtures import write_tiny_gguf

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import int4_layout
from specchat.backend.kernels.quant_linear import Int4Linear, Int8Linear, Q8Embedding
from specchat.backend.models.gguf import gguf_file
from specchat.backend.models.gguf.gguf_file import GgufFormatError, read_gguf
from specchat.backend.models.loading.quantized import from_gguf

CPU = torch.device("cpu")


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def _float_model(path):
    """transformers' own de-quantisation of the file (what ``quantization: none`` runs)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_equal_the_gguf_packages_dequantisation(tmp_path, kind):
    g = read_gguf(write_tiny_gguf(tmp_path / "m.gguf", weights=kind))
    tensor = g.tensors["blk.0.ffn_gate.weight"]
    expected = gguf.quants.dequantize(tensor.raw, gguf.GGMLQuantizationType[kind]).reshape(tensor.shape)
    if kind == "Q8_0":
        codes, d = gguf_file.q8_0_blocks(tensor)
        got = codes.view(codes.shape[0], -1, 32).float() * d[..., None]
    else:
        codes, d, m = gguf_file.q4_blocks(tensor)
        got = codes.view(codes.shape[0], -1, 32).float() * d[..., None] + m[..., None]
    assert np.array_equal(got.reshape(tensor.shape).numpy(), expected)


def test_q4_1_file_loads_as_its_own_weights(tmp_path):
    """With float32 scales the int4 layers hold exactly the file's weights (transformers' de-quantisation, rows
    unpermuted for q/k); with bfloat16 scales every weight stays within 2^-8 of its group's magnitude."""
    if int4_layout.cpu_block_n() is None:
        pytest.skip("this CPU's int4 layout cannot be read back here")
    # 4 KV heads: every projection has 64 or 128 rows, whole blocks of the layout (64 rows with AVX-512)
    path = write_tiny_gguf(tmp_path / "m.gguf", weights="Q4_1", embedding="Q8_0", kv_heads=4)
    reference = _float_model(path)
    exact, notes = from_gguf(read_gguf(path), _config(path), "int4-torch", CPU, exact_scales=True)
    fast, _ = from_gguf(read_gguf(path), _config(path), "int4-torch", CPU)
    assert any("output head re-quantised to int8" in note for note in notes)
    names = [n for n, m in exact.named_modules() if isinstance(m, Int4Linear)]
    assert len(names) == 2 * 7
    for name in names:
        want = reference.get_submodule(name).weight
        assert torch.equal(exact.get_submodule(name).dequantized(), want), name
        layer = fast.get_submodule(name)
        sz = layer.scales_zeros.float()
        bound = (8 * sz[..., 0].abs() + sz[..., 1].abs()).t().repeat_interleave(32, dim=1) * 2**-8
        assert ((layer.dequantized() - want).abs() <= bound + 1e-7).all(), name
    assert isinstance(fast.model.embed_tokens, Q8Embedding)
    assert torch.equal(fast.model.embed_tokens.dequantized(), reference.model.embed_tokens.weight)
    head = fast.lm_head
    assert isinstance(head, Int8Linear)
    want = reference.lm_head.weight
    row_max = want.abs().amax(-1, keepdim=True)  # int8 per row: half a step, plus the bfloat16 scale's rounding
    assert ((head.dequantized() - want).abs() <= row_max / 127 / 2 + row_max * 2**-8).all()


def test_logits_close_to_the_float_model(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", weights="Q4_1", embedding="Q8_0")
    reference = _float_model(path)
    model, _ = from_gguf(read_gguf(path), _config(path), "int4-torch", CPU)
    ids = torch.tensor([[5, 80, 120, 9, 200, 31]])
    with torch.inference_mode():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("quantization", ["int4-torch", "int8-torch"])
def test_other_types_are_requantised_and_named(tmp_path, quantization):
    path = write_tiny_gguf(tmp_path / "m.gguf", weights="F16")
    model, notes = from_gguf(read_gguf(path), _config(path), quantization, CPU)
    assert any("F16" in note for note in notes)
    layer_type = Int8Linear  # F16 has more than 4 bits a weight: never squeezed to int4
    assert all(
        isinstance(model.get_submodule(f"model.layers.0.{p}"), layer_type)
        for p in ("self_attn.q_proj", "mlp.down_proj")
    )


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_damaged_file_is_named(tmp_path, damage):
    path = write_tiny_gguf(tmp_path / "m.gguf", weights="Q4_1")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x07" * 4096, "empty": b""}[damage])
    with pytest.raises(GgufFormatError):
        read_gguf(path)


def test_an_unsupported_architecture_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", weights="Q4_1")
    config = _config(path)
    config.model_type = "gemma2"
    with pytest.raises(ModelLoadError, match="quantization: none"):
        from_gguf(read_gguf(path), config, "int4-torch", CPU)


@pytest.mark.slow
def test_the_embedded_files_q4_1_blocks_are_kept_exactly(capsys):
    """Every Q4_1 tensor of the embedded GGUF: (q - 8)·d + (m + 8·d) equals the file's d·q + m bit for bit with
    float32 scale and zero; with the bfloat16 ones the kernels take, each weight stays within 2^-8 of its
    block's |(q - 8)·d| + |m + 8·d| (the error is printed, for benchmarks/RESULTS.md). The tied Q8_0
    embedding re-quantised to an int8 head per row: within half a row step plus the scale's rounding."""
    from specchat.backend.models.loading.pair import packaged_gguf_path

    g = read_gguf(packaged_gguf_path())
    worst = total = count = 0.0
    moved = weights = 0
    q41 = [t for t in g.tensors.values() if t.ggml_type == gguf_file.Q4_1]
    assert len(q41) >= 7 * 30
    for tensor in q41:
        codes, d, m = gguf_file.q4_blocks(tensor)
        want = (
            torch.from_numpy(gguf.quants.dequantize(tensor.raw, gguf.GGMLQuantizationType.Q4_1))
            .reshape(tensor.shape)
            .view(codes.shape[0], -1, 32)
        )
        q = codes.view(codes.shape[0], -1, 32).float() - 8
        zero = m + 8 * d
        assert torch.equal(q * d[..., None] + zero[..., None], want), tensor.name
        fast = q * d.bfloat16().float()[..., None] + zero.bfloat16().float()[..., None]
        error = (fast - want).abs()
        assert (error <= ((q.abs() * d[..., None]) + zero.abs()[..., None]) * 2**-8).all(), tensor.name
        relative = error / d.abs().clamp_min(1e-12)[..., None]
        worst, total, count = max(worst, relative.max().item()), total + relative.sum().item(), count + error.numel()
        moved += int((error > 0).sum())
        weights += error.numel()
    head = g.tensors["token_embd.weight"]
    codes8, d8 = gguf_file.q8_0_blocks(head)
    embedding = (codes8.view(codes8.shape[0], -1, 32).float() * d8[..., None]).view(codes8.shape)
    layer = Int8Linear.from_weight(embedding)
    head_error = (layer.dequantized() - embedding).abs()
    row_max = embedding.abs().amax(-1, keepdim=True)
    assert (head_error <= row_max / 254 + row_max * 2**-8).all()
    with capsys.disabled():
        print(
            f"\nQ4_1 with bfloat16 scales: {moved / weights:.1%} of {weights} weights move, by at most "
            f"{worst:.2%} of their block's d, mean {total / count:.2%}; int8 head from Q8_0: mean |error| "
            f"{head_error.mean():.2e}, max {head_error.max():.2e} (mean |w| {embedding.abs().mean():.2e})"
        )
