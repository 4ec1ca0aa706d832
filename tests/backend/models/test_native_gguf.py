"""GGUF files into the native model (backend/models/loading/native_loading.py, native_arch.py): tiny llama / mistral /
qwen2
files in each block type the kernels take, and a Q4_K_M-like mix, give the logits of transformers' forward over
the file's own blocks (its projections through the same block kernels, so 8-bit activations on both sides) to
float rounding, and the same greedy tokens; llama.cpp's permuted q/k
rows are put back; the weights are the file's blocks (no float copy); a file missing a tensor is a clear error."""

from __future__ import annotations

import pytest
import torch
from gguf_files import through_kernels, write_tiny_gguf
from native_fixtures import native_ready  # noqa: F401  (a fixture)
from tiny_models import build_tiny, random_ids

from specchat.backend.errors import ModelLoadError
from specchat.backend.kv.kv_cache import PagedKVCache
from specchat.backend.models.gguf.gguf_file import read_gguf
from specchat.backend.models.loading.native_loading import from_gguf

# K-quants take rows of 256 weights: a wider tiny model for them.
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
CASES = {
    "F16": ({"default": "F16"}, {}),
    "BF16": ({"default": "BF16"}, {}),
    "Q8_0": ({"default": "Q8_0"}, {}),
    "Q4_0": ({"default": "Q4_0", "embed": "Q8_0"}, {}),
    "Q4_1": ({"default": "Q4_1"}, {}),
    "Q5_0": ({"default": "Q5_0"}, {}),
    "Q5_1": ({"default": "Q5_1"}, {}),
    "Q4_K": ({"default": "Q4_K"}, WIDE),
    "Q5_K": ({"default": "Q5_K"}, WIDE),
    "Q6_K": ({"default": "Q6_K"}, WIDE),
    "Q4_K_M": ({"default": "Q4_K", "head": "Q6_K", "down": "Q6_K", "embed": "Q4_K"}, WIDE),
}


def _compare(model, loaded, prompt=40):
    cache = PagedKVCache.for_model(model.config, max_tokens=128, block_size=16, dtype=torch.float32, device="cpu")
    loaded.native.bind(cache)
    ids = random_ids(prompt, seed=3)
    logits, _ = loaded.native.forward(cache.new_sequence(), torch.tensor(ids), prompt)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    return logits, expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_block_type_gives_transformers_logits(case, native_ready, tmp_path):  # noqa: F811
    types, shape = CASES[case]
    model = build_tiny("llama", **shape)
    path = tmp_path / f"tiny-{case}.gguf"
    stored = write_tiny_gguf(model, path, types)  # model now holds the file's de-quantised weights
    loaded = from_gguf(read_gguf(path), model.config)
    through_kernels(model, stored)
    logits, expected = _compare(model, loaded)
    # Float types: summation order only. Quantised types: a rounding difference upstream can flip an activation's
    # 8-bit code (a 1/127 step of its block), so rows after the first agree to a few percent, not to rounding.
    tolerance = 1e-3 if case in ("F16", "BF16") else 0.2
    assert float((logits[0] - expected[0]).abs().max()) < 1e-4 * float(expected.std())  # the first row: none
    error = float((logits - expected).abs().max())
    assert error < tolerance * float(expected.std())
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error  # greedy identical wherever the error cannot swap the top two
    assert clear.sum() >= len(clear) // 2
    assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear])
    stored = {name for name in (types[k] for k in types)}
    assert loaded.description.endswith("as stored") and stored <= set(loaded.description.split(" as")[0].split(", "))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_llama_family_files(family, native_ready, tmp_path):  # noqa: F811
    model = build_tiny(family)
    path = tmp_path / f"{family}.gguf"
    stored = write_tiny_gguf(model, path, {"default": "Q8_0"})
    loaded = from_gguf(read_gguf(path), model.config)
    through_kernels(model, stored)
    logits, expected = _compare(model, loaded)
    assert float((logits - expected).abs().max()) < 0.1 * float(expected.std())
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_the_weights_are_the_files_blocks(native_ready, tmp_path):  # noqa: F811
    model = build_tiny("llama", **WIDE)
    path = tmp_path / "q4.gguf"
    write_tiny_gguf(model, path, {"default": "Q4_0"})
    loaded = from_gguf(read_gguf(path), model.config)
    matrices = sum(t.raw.nbytes for t in read_gguf(path).tensors.values() if len(t.shape) == 2)
    assert loaded.weight_bytes == matrices  # 4.5 bits a weight, as the file: no float copy, no re-quantisation


def test_a_missing_tensor_is_named(native_ready, tmp_path):  # noqa: F811
    model = build_tiny("llama")
    path = tmp_path / "full.gguf"
    write_tiny_gguf(model, path, {"default": "Q8_0"})
    source = read_gguf(path)
    del source.tensors["blk.1.attn_v.weight"]
    with pytest.raises(ModelLoadError, match=r"full.gguf: no blk.1.attn_v.weight tensor; it does not hold a complete"):
        from_gguf(source, model.config)


@pytest.mark.parametrize("case", ["Q4_0", "Q4_K_M", "Q8_0"])
def test_a_tokens_logits_alone_equal_those_among_16_rows(case, native_ready, tmp_path):  # noqa: F811
    """Row independence through the real block kernels (8-bit activations per row): each of 16 tokens verified
    in one pass gets bit for bit the logits a one-token pass gives it, so every drafter and γ keep the reply."""
    types, shape = CASES[case]
    model = build_tiny("llama", **shape)
    path = tmp_path / f"rows-{case}.gguf"
    write_tiny_gguf(model, path, types)
    loaded = from_gguf(read_gguf(path), model.config)
    cache = PagedKVCache.for_model(model.config, max_tokens=128, block_size=16, dtype=torch.bfloat16, device="cpu")
    loaded.native.bind(cache)
    ids = random_ids(36, seed=5)
    seq = cache.new_sequence()
    loaded.native.forward(seq, torch.tensor(ids[:20]), 1)
    seq.commit(20)
    alone = []
    for token in ids[20:]:
        alone.append(loaded.native.forward(seq, torch.tensor([token]), 1)[0])
        seq.commit(1)
    seq.truncate(20)
    together, _ = loaded.native.forward(seq, torch.tensor(ids[20:]), 16)
    assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_every_gguf_architecture_runs_natively_from_the_files_config(family, native_ready, tmp_path):  # noqa: F811
    """Each GGUF architecture of the models' tables (gguf_arch.ARCHS) loads into the native model with the
    configuration the file states (gguf_tensors.config_of: llama 3 rope from rope_freqs, gemma's windows and
    soft-caps, phi3's fused qkv / gate_up, gemma's 1 + w norms as stored), and gives the logits of transformers'
    forward over the file's weights (F16: the only difference is summation order)."""
    from gguf_fixtures import gguf_pair, reference_model
    from transformers import AutoConfig

    from specchat.backend.models.gguf.gguf_tensors import config_of

    _, path = gguf_pair(family, "F16", tmp_path)
    parsed = read_gguf(path)
    config = AutoConfig.for_model(**config_of(parsed))
    loaded = from_gguf(parsed, config)
    reference = reference_model(path)
    logits, expected = _compare(reference, loaded, prompt=24)
    assert float((logits - expected).abs().max()) < 1e-3 * float(expected.std())
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_native_taps_are_transformers_hidden_states_by_the_runners_indices(native_ready, tmp_path):  # noqa: F811
    """Draft heads ask for taps by transformers' ``output_hidden_states`` index (forward_paths.check_taps); the
    native model taps the stream after a layer: NativePath.native_taps maps one onto the other, the final norm's output
    included, and refuses the embeddings (tap 0)."""
    from specchat.backend.engine.forward_paths import NativePath

    model = build_tiny("llama")
    path = tmp_path / "tiny-F16.gguf"
    write_tiny_gguf(model, path, {"default": "F16"})
    loaded = from_gguf(read_gguf(path), model.config)
    layers = model.config.num_hidden_layers
    taps = (1, layers - 1, layers)
    cache = PagedKVCache.for_model(model.config, max_tokens=64, block_size=16, dtype=torch.float32, device="cpu")
    loaded.native.bind(cache)
    ids = random_ids(12, seed=5)

    native_path = NativePath(model, loaded.native)
    _, tapped = loaded.native.forward(cache.new_sequence(), torch.tensor(ids), 1, None, native_path.native_taps(taps))
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for tap, got in zip(taps, tapped, strict=True):
        want = hidden[tap][0].float()
        assert float((got - want).abs().max()) < 1e-3 * float(want.std()) + 1e-5, tap
    with pytest.raises(ModelLoadError, match="tap 0"):
        native_path.native_taps((0, layers))


def test_a_qwen2_files_light_config_is_transformers_own(tmp_path):
    """A qwen2 GGUF states no sliding window; the native loader fills Qwen2Config's defaults (every layer full
    attention) so the light config covers it and no transformers import is needed: the native architecture made
    from it equals the one made from transformers' AutoConfig of the same values."""
    from dataclasses import fields

    from gguf_fixtures import gguf_pair
    from transformers import AutoConfig

    from specchat.backend.models.gguf.gguf_tensors import config_of
    from specchat.backend.models.loading import skeleton
    from specchat.backend.models.loading.native_arch import architecture
    from specchat.backend.models.loading.native_loading import light_defaults

    _, path = gguf_pair("qwen2", "F16", tmp_path)
    values = config_of(read_gguf(path))
    filled = light_defaults(values)
    assert skeleton._usable(filled) and not skeleton._usable(values)
    light, reference = architecture(skeleton.LightConfig(filled)), architecture(AutoConfig.for_model(**values))
    for field in fields(light):
        ours, theirs = getattr(light, field.name), getattr(reference, field.name)
        if field.name == "rotaries":
            assert [(r.scaling, r.inv_freq.tolist()) for r in ours] == [
                (r.scaling, r.inv_freq.tolist()) for r in theirs
            ]
        else:
            assert ours == theirs, field.name


@pytest.mark.parametrize("tied", [False, True])
def test_train_head_starts_from_the_files_output_layer_and_final_norm(tied, native_ready, tmp_path):  # noqa: F811
    """train-head's frozen output layer: the stored rows of the draft ids (the embedding's when tied), de-quantised
    from the file's blocks, and the final norm as the pass multiplies by it (it was None for native models)."""
    from specchat.backend.models.gguf.gguf_file import dequantize
    from specchat.backend.training.pipeline import _output_layer

    model = build_tiny("llama", tie_word_embeddings=tied)
    path = tmp_path / "m.gguf"
    write_tiny_gguf(model, path, {"default": "Q8_0"})
    source = read_gguf(path)
    loaded = from_gguf(source, model.config)
    d2t = torch.tensor([5, 5, 0, 7])  # draft id i -> target id i + d2t[i]
    rows, norm = _output_layer(loaded, loaded.get_input_embeddings(), d2t, torch.device("cpu"))
    stored = dequantize(source.tensors["token_embd.weight" if tied else "output.weight"]).float()
    assert rows is not None and norm is not None
    assert torch.equal(rows, stored[torch.tensor([5, 6, 2, 10])])
    assert torch.allclose(norm, model.model.norm.weight)
    if not tied:
        assert not torch.allclose(rows, dequantize(source.tensors["token_embd.weight"]).float()[[5, 6, 2, 10]])


def test_a_gemma_heads_norm_starts_from_one_plus_the_stored_weight(native_ready, tmp_path):  # noqa: F811
    """Gemma's RMSNorm multiplies by 1 + w (safetensors store w): a head's plain x · w norm must start at 1 + w."""
    from native_fixtures import tiny_native

    from specchat.backend.training.pipeline import _output_layer

    model, loaded, _ = tiny_native("gemma2", tmp_path)
    with torch.no_grad():
        model.model.norm.weight.normal_()
    loaded.native.set_final_norm(model.model.norm.weight)
    _, norm = _output_layer(
        loaded, loaded.get_input_embeddings(), torch.zeros(3, dtype=torch.long), torch.device("cpu")
    )
    assert norm is not None and torch.allclose(norm, 1 + model.model.norm.weight)
