"""The light int4 model (backend/models/loading/skeleton.py) against transformers' model classes it stands in for."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from foundation_fixtures import write_tiny_gguf
from paged import paged_forward
from tiny_models import SMOLLM_ATTENTION, build_tiny, one_thread, random_ids, tiny_config  # noqa: F401  (one_thread: a fixture)
from transformers import AutoConfig, AutoTokenizer

from specchat.backend.engine.runner import ModelRunner
from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import compact
from specchat.backend.kv.attention import ATTN_IMPLEMENTATION
from specchat.backend.kv.kv_cache import PagedKVCache, kv_geometry
from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.gguf import convert
from specchat.backend.models.gguf.gguf_file import read_gguf
from specchat.backend.models.loading import capture, quantized, skeleton
from specchat.backend.models.loading.pair import LoadedModel, packaged_gguf_path
from specchat.backend.models.loading.quantized import from_gguf, quantize_model

CPU = torch.device("cpu")
FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "rope_parameters",
    "hidden_act",
    "mlp_bias",
    "attention_bias",
    "tie_word_embeddings",
    "head_dim",
    "sliding_window",
    "layer_types",
    "architectures",
    "_name_or_path",
)


def _saved(tmp_path, family: str, **overrides):
    tiny_config(family, **overrides).save_pretrained(tmp_path)
    return skeleton.read_config(tmp_path), AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", compact.ARCHITECTURES)
def test_the_light_config_holds_transformers_values(tmp_path, family):
    light, ref = _saved(tmp_path, family)
    assert light is not None
    for name in FIELDS:
        assert getattr(light, name, None) == getattr(ref, name, None), name
    assert kv_geometry(light) == kv_geometry(ref)
    assert light.to_transformers().to_dict() == ref.to_dict()


@pytest.mark.parametrize("family", compact.ARCHITECTURES)
@pytest.mark.parametrize(
    "shape", [{}, {**SMOLLM_ATTENTION, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}]
)
def test_the_rotary_embedding_gives_transformers_bits(tmp_path, family, shape):
    light, _ = _saved(tmp_path, family, **shape)
    theirs = build_tiny(family, **shape).model.rotary_emb
    positions = torch.arange(0, 9000)[None]
    x = torch.zeros(1, 1, dtype=torch.float32)
    for want, got in zip(theirs(x, positions), skeleton.RotaryEmbedding(light)(x, positions), strict=True):
        assert torch.equal(want, got)


def _light_copy(model, light_config) -> skeleton.LightCausalLM:
    """A light model holding deep copies of a quantised transformers model's modules."""
    light = skeleton.LightCausalLM(light_config)
    source = copy.deepcopy(model)
    for mine, theirs in zip(light.model.layers, source.model.layers, strict=True):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(mine.self_attn, name, getattr(theirs.self_attn, name))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mine.mlp, name, getattr(theirs.mlp, name))
        mine.input_layernorm.weight = theirs.input_layernorm.weight
        mine.post_attention_layernorm.weight = theirs.post_attention_layernorm.weight
    light.model.embed_tokens, light.lm_head = source.model.embed_tokens, source.lm_head
    light.model.norm.weight = source.model.norm.weight
    light.set_attn_implementation(ATTN_IMPLEMENTATION)
    return light


def _cache(config) -> PagedKVCache:
    return PagedKVCache.for_model(config, max_tokens=256, dtype=torch.bfloat16, device="cpu")


def _same_compact_logits(reference, light) -> None:
    """Both models' compact forwards give the same bits: a prefill over the row-wise limit, steps, a short pass."""
    fast_ref, fast_light = compact.build(reference), compact.build(light)
    seqs = [_cache(reference.config).new_sequence(), _cache(light.config).new_sequence()]
    for chunk, keep in [
        (random_ids(80, seed=1), 3),
        *[([t], 1) for t in random_ids(6, seed=2)],
        (random_ids(5, seed=3), 5),
    ]:
        want = paged_forward(reference, seqs[0], chunk, logits_to_keep=keep, fast=fast_ref)
        got = paged_forward(light, seqs[1], chunk, logits_to_keep=keep, fast=fast_light)
        assert torch.equal(got, want)
        for seq in seqs:
            seq.commit(len(chunk))


@pytest.mark.parametrize("family", compact.ARCHITECTURES)
@pytest.mark.parametrize("quantization", ["int4-torch", "int8-torch"])
def test_the_light_models_compact_forward_equals_transformers_models(tmp_path, family, quantization):
    """Mistral and Qwen2 cross their sliding window here; Qwen2 has qkv bias."""
    from specchat.backend.kv import attention

    light_config, _ = _saved(tmp_path, family, **SMOLLM_ATTENTION)
    model = build_tiny(family, **SMOLLM_ATTENTION)
    quantize_model(model, quantization, CPU)
    attention.use_paged_attention(model)
    _same_compact_logits(model, _light_copy(model, light_config))


@pytest.fixture
def tiny_folder(isolated_dirs, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", weights="Q4_1", embedding="Q8_0")
    return gguf, convert.ensure_converted(gguf, weights=False)


def test_from_gguf_builds_the_same_model_both_ways(tiny_folder):
    from specchat.backend.kv import attention

    gguf, folder = tiny_folder
    light_config = skeleton.light_config(folder, device=CPU, attn_implementation=ATTN_IMPLEMENTATION)
    assert light_config is not None
    light, light_notes = from_gguf(read_gguf(gguf), light_config, "int4-torch", CPU)
    reference, notes = from_gguf(read_gguf(gguf), AutoConfig.from_pretrained(folder), "int4-torch", CPU)
    assert isinstance(light, skeleton.LightCausalLM) and light_notes == notes
    theirs = dict(reference.named_parameters()) | dict(reference.named_buffers())
    mine = dict(light.named_parameters()) | dict(light.named_buffers())
    assert set(mine) <= set(theirs) | {"model.rotary_emb.inv_freq"}
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    light.set_attn_implementation(ATTN_IMPLEMENTATION)
    attention.use_paged_attention(reference)
    _same_compact_logits(reference, light)
    # transformers' forward over the light model's tensors (specchat bench's baselines) is the reference's.
    twin = quantized.transformers_model(light)
    twin.set_attn_implementation("sdpa")
    reference.set_attn_implementation("sdpa")
    ids = torch.tensor([random_ids(12, seed=7)])
    with torch.inference_mode():
        assert torch.equal(twin(ids).logits, reference(ids).logits)


def test_the_tokenizer_is_the_same_with_the_light_config(tiny_folder):
    _, folder = tiny_folder
    plain = AutoTokenizer.from_pretrained(folder)
    light = AutoTokenizer.from_pretrained(folder, config=skeleton.read_config(folder))
    assert type(light) is type(plain) and light.get_vocab() == plain.get_vocab()
    text = "the tiny model says hello, the end"
    assert light(text)["input_ids"] == plain(text)["input_ids"]
    assert light.all_special_ids == plain.all_special_ids


def test_the_light_model_runs_only_through_the_compact_forward(tiny_folder, monkeypatch):
    gguf, folder = tiny_folder
    light_config = skeleton.read_config(folder)
    model, _ = from_gguf(read_gguf(gguf), light_config, "int4-torch", CPU)
    with pytest.raises(ModelLoadError, match="compact forward"):
        model(torch.tensor([[1, 2]]))
    with pytest.raises(ModelLoadError, match="'sdpa'"):
        model.set_attn_implementation("sdpa")
    spec = load_pairs()["smollm2-135m"].target
    loaded = LoadedModel(model=model, tokenizer=None, spec=spec, device=CPU, dtype=torch.bfloat16, generation_config={})
    monkeypatch.setenv("SPECCHAT_COMPACT", "0")
    with pytest.raises(ModelLoadError, match="SPECCHAT_COMPACT='0'"):
        ModelRunner(loaded, kv_tokens=64)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "another rope type"),
        ({"hidden_act": "gelu"}, "another activation"),
        ({"mlp_bias": True}, "MLP bias"),
        ({"model_type": "qwen3"}, "another architecture"),
        ({"rms_norm_eps": None}, "a field missing"),
        ({"hidden_size": "576"}, "a count that is not a number"),
        ({"num_attention_heads": 0}, "no heads"),
    ],
)
def test_configs_it_does_not_cover_keep_transformers(tmp_path, change, why):
    values = tiny_config("llama").to_dict()
    values.update(change)
    values = {k: v for k, v in values.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(values), encoding="utf-8")
    assert skeleton.read_config(tmp_path) is None, why


def test_only_the_compact_forwards_settings_get_the_light_model(tmp_path, monkeypatch):
    tiny_config("llama").save_pretrained(tmp_path)
    assert skeleton.light_config(tmp_path, device=CPU, attn_implementation=ATTN_IMPLEMENTATION) is not None
    assert skeleton.light_config(tmp_path, device=CPU, attn_implementation="sdpa") is None
    assert skeleton.light_config(tmp_path, device=torch.device("cuda"), attn_implementation=ATTN_IMPLEMENTATION) is None
    monkeypatch.setenv("SPECCHAT_COMPACT", "0")
    assert skeleton.light_config(tmp_path, device=CPU, attn_implementation=ATTN_IMPLEMENTATION) is None
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    monkeypatch.delenv("SPECCHAT_COMPACT")
    assert skeleton.read_config(tmp_path) is None  # the transformers path then names the damaged file


def test_the_gguf_readers_bars_follow_the_open_capture():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    before = gguf_utils.tqdm
    with capture.capture_library_output(lambda message, fraction: None):
        with capture.routed_gguf_progress(gguf_utils):
            assert gguf_utils.tqdm is not before and gguf_utils.tqdm.__module__ == capture.__name__
        assert gguf_utils.tqdm is before
    with capture.routed_gguf_progress(gguf_utils):  # no capture open: left alone
        assert gguf_utils.tqdm is before


@pytest.mark.slow
@pytest.mark.parametrize("native", ["1", "0"])
def test_the_default_starts_without_transformers_model_code(native, monkeypatch):
    """The embedded default loads in a fresh process as the CPU native model (or, with it off, the light model
    of the compact forward), and transformers' modelling code (and its GGUF reader, ~1.5-4 s of a start) is
    never imported."""
    from specchat.backend.kernels import native_build

    if native == "1" and native_build.unavailable() is not None:
        pytest.skip(native_build.unavailable())
    monkeypatch.setenv("SPECCHAT_NATIVE", native)
    script = (
        "import sys; from specchat.backend.engine.engine import load_engine; "
        "from specchat.backend.models.catalog.config import load_pairs; "
        "e = load_engine(load_pairs()['smollm2-135m'], device='cpu'); "
        "print(type(e.target.model).__name__, e.runner.path, "
        "[m for m in ('transformers.modeling_utils', 'transformers.modeling_gguf_pytorch_utils', "
        "'torch._dynamo') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    expected = "NativeCausalLM cpu-native []" if native == "1" else "LightCausalLM cpu-compact []"
    assert out.stdout.split("\n")[-2] == expected, out.stdout + out.stderr


@pytest.mark.slow
def test_the_embedded_models_light_logits_equal_the_transformers_skeletons(isolated_dirs):
    from specchat.backend.kv import attention

    gguf = packaged_gguf_path()
    folder = convert.ensure_converted(gguf, weights=False)
    light_config = skeleton.read_config(folder)
    reference_config = AutoConfig.from_pretrained(folder)
    assert light_config is not None
    for name in FIELDS:
        assert getattr(light_config, name, None) == getattr(reference_config, name, None), name
    light, _ = from_gguf(read_gguf(gguf), light_config, "int4-torch", CPU)
    reference, _ = from_gguf(read_gguf(gguf), reference_config, "int4-torch", CPU)
    light.set_attn_implementation(ATTN_IMPLEMENTATION)
    attention.use_paged_attention(reference)
    _same_compact_logits(reference, light)
