"""A light model object for the compact forward: the modules ``compact.build`` reads, no transformers model code.

Why: the int4 default runs on CPU through the compact forward (``backend/kernels/compact.py``), which reads the
model's tensors and never calls its modules' ``forward``. Building transformers' model classes for it (and registering
the paged attention with ``transformers.AttentionInterface``) imports ``transformers.modeling_utils`` and, through it,
``torch.distributed.tensor`` and ``torch._dynamo``: seconds of a start spent on code that never runs
(``benchmarks/RESULTS.md``, "Start time and memory"). Even transformers' config classes (``LlamaConfig``) import its
weight-conversion machinery; so this module reads ``config.json`` itself as well.

Contract:

- :func:`light_config(folder, device=..., attn_implementation=...)` returns a :class:`LightConfig` of the
  converted folder's ``config.json`` when the compact forward will run the model there: CPU, the paged
  attention asked for (the caller runs it through ``backend/engine/runner.py``), ``SPECCHAT_COMPACT`` not
  switched off, a llama / mistral / qwen2 config with SiLU, no MLP bias and the default rotary embedding,
  every field the model reads present; else None (the caller keeps transformers' model, as before).
  :func:`read_config(folder)` applies only the configuration's conditions (the tokenizer's loading uses it).
  A ``config.json`` that cannot be read gives None: the transformers path then reports it as before.
- :class:`LightConfig` holds ``config.json``'s values as attributes, as transformers' config object does after
  loading the same file (``tests/backend/models/test_skeleton.py`` compares the fields the model reads, for
  each family); :meth:`LightConfig.to_transformers` makes transformers' config of the same values.
- :class:`LightCausalLM` (built by ``quantized.from_gguf`` when given a :class:`LightConfig`) has
  transformers' attribute layout: ``model.embed_tokens / rotary_emb / norm / layers[i].self_attn.{q,k,v,o}_proj,
  layer_idx, head_dim, scaling, sliding_window / mlp.{gate,up,down}_proj, act_fn / input_layernorm,
  post_attention_layernorm (weight, variance_epsilon)``, ``lm_head``, ``config``, ``generation_config``. Its
  rotary embedding gives cos/sin bit for bit as transformers' (``default`` rope type). Calling the model
  itself raises :class:`ModelLoadError`: only the compact forward runs it; ``quantized.transformers_model``
  gives transformers' model over the same tensors where a transformers forward is wanted (``specchat bench``'s
  baselines, ``backend/bench/hf.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import compact, switched_off
from specchat.backend.kv.attention import ATTN_IMPLEMENTATION

# Fields the light model and its users read (compact.py, kv_cache.kv_geometry, attention.check_supported,
# quantized.py): a config.json lacking one keeps transformers' config, which would supply a default.
_REQUIRED = (
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
)
_FAMILY_FIELDS = {"mistral": ("sliding_window",), "qwen2": ("sliding_window", "layer_types")}


class LightConfig:
    """``config.json``'s values as attributes (see the module docstring)."""

    # The fields the light model reads, set from config.json by __init__ (read_config checks they are there;
    # sliding_window and layer_types only for the families of _FAMILY_FIELDS, which alone read them).
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    hidden_act: str
    sliding_window: int | None
    layer_types: list[str]

    def __init__(self, values: dict[str, Any], name_or_path: str = "") -> None:
        self._values = dict(values)
        self.__dict__.update(values)
        self._name_or_path = name_or_path  # as transformers sets it: the folder (AutoTokenizer matches on it)
        self._attn_implementation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def to_transformers(self) -> Any:
        """transformers' config of the same values (what ``AutoConfig.from_pretrained`` makes of the file)."""
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        config = CONFIG_MAPPING[self._values["model_type"]].from_dict(dict(self._values))
        config._name_or_path = self._name_or_path
        return config


def _usable(values: Any) -> bool:
    """Whether the light model covers this configuration exactly (see the module docstring)."""
    if not isinstance(values, dict) or values.get("model_type") not in compact.ARCHITECTURES:
        return False
    fields = _REQUIRED + _FAMILY_FIELDS.get(values["model_type"], ())
    if any(name not in values for name in fields):
        return False
    counts = [values[name] for name in _REQUIRED[1:9] if name != "rms_norm_eps"]
    if not all(type(n) is int and n > 0 for n in counts) or type(values["rms_norm_eps"]) not in (int, float):
        return False  # not what transformers writes: its own path handles the file, as before
    rope = values["rope_parameters"]
    return (
        values["hidden_act"] == "silu"
        and not values.get("mlp_bias", False)
        and isinstance(rope, dict)
        and rope.get("rope_type") == "default"
        and isinstance(rope.get("rope_theta"), (int, float))
        and set(rope) <= {"rope_type", "rope_theta"}
    )


def read_config(folder: Path) -> LightConfig | None:
    """The folder's ``config.json`` as a :class:`LightConfig` when the light model covers it, else None."""
    try:
        values = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return LightConfig(values, str(folder)) if _usable(values) else None


def generation_values(folder: Path) -> dict:
    """``generation_config.json`` of ``folder`` as ``GenerationConfig.from_pretrained(folder).to_diff_dict()`` gives
    the values the engine reads (transformers 5's defaults are all None, which the diff leaves out), read without
    transformers. Raises OSError / ValueError for a file that cannot be read or is not a JSON object."""
    values = json.loads((Path(folder) / "generation_config.json").read_text(encoding="utf-8"))
    if not isinstance(values, dict):
        raise ValueError("not a JSON object")
    return {key: value for key, value in values.items() if key != "transformers_version" and value is not None}


def compact_will_run(device: torch.device, attn_implementation: str) -> bool:
    """Whether a model loaded for ``device`` with ``attn_implementation`` runs the compact forward (where its
    configuration allows it: :func:`read_config`)."""
    return device.type == "cpu" and attn_implementation == ATTN_IMPLEMENTATION and not switched_off("SPECCHAT_COMPACT")


def light_config(folder: Path, *, device: torch.device, attn_implementation: str) -> LightConfig | None:
    """A :class:`LightConfig` when the compact forward will run the model (see the module docstring)."""
    return read_config(folder) if compact_will_run(device, attn_implementation) else None


def _head_dim(config: LightConfig) -> int:
    # As llama's, mistral's and qwen2's attention layers take it: the config's, else hidden / heads.
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class Placeholder(nn.Module):
    """Where ``quantized.from_gguf`` puts a layer: a meta tensor of the layer's shape until then, so a layer it
    does not fill is noticed. Not ``nn.Linear`` / ``nn.Embedding``: their random initialisation, even on the
    meta device, imports ``torch._dynamo`` (seconds: ``benchmarks/RESULTS.md``, "Figures moved out of the code")."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns, device="meta"), requires_grad=False)


class RMSNorm(nn.Module):
    """A norm's weight and epsilon (the compact forward applies them with ``F.rms_norm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """transformers' ``LlamaRotaryEmbedding`` (also Mistral's and Qwen2's) for the ``default`` rope type, in
    the same operations and dtypes, so cos/sin are the same bits."""

    def __init__(self, config: LightConfig) -> None:
        super().__init__()
        base = config.rope_parameters["rope_theta"]
        dim = _head_dim(config)
        self.attention_scaling = 1.0
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LightConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = _head_dim(config)
        self.scaling = self.head_dim**-0.5
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = Placeholder(heads * self.head_dim, hidden)
        self.k_proj = Placeholder(kv_heads * self.head_dim, hidden)
        self.v_proj = Placeholder(kv_heads * self.head_dim, hidden)
        self.o_proj = Placeholder(hidden, heads * self.head_dim)
        # Qwen2's layers hold their window (None for a full-attention layer); Mistral's model reads it from the
        # config (compact.py does too); Llama has none.
        self.sliding_window = None
        if config.model_type == "qwen2" and config.layer_types[layer_idx] == "sliding_attention":
            self.sliding_window = config.sliding_window


class MLP(nn.Module):
    def __init__(self, config: LightConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = Placeholder(inter, hidden)
        self.up_proj = Placeholder(inter, hidden)
        self.down_proj = Placeholder(hidden, inter)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, config: LightConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, config: LightConfig) -> None:
        super().__init__()
        self.embed_tokens = Placeholder(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LightCausalLM(nn.Module):
    """See the module docstring. ``quantized.from_gguf`` fills every tensor (they start on the meta device)."""

    def __init__(self, config: LightConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = Placeholder(config.vocab_size, config.hidden_size)
        self.generation_config: dict | None = None  # skeleton.generation_values, set by the loader

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_attn_implementation(self, name: str) -> None:
        if name != ATTN_IMPLEMENTATION:
            raise ModelLoadError(
                f"this model was loaded for specchat's compact forward, which attends through "
                f"{ATTN_IMPLEMENTATION!r}; it cannot use {name!r} (load it with that attention, or "
                "use transformers_model())"
            )
        self.config._attn_implementation = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ModelLoadError(
            "this model runs only through specchat's compact forward (backend/kernels/compact.py, "
            "via the model runner); quantized.transformers_model(model) runs transformers' forward"
        )
