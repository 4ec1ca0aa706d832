"""Models with int4 / int8 weights through PyTorch's kernels (``quantization: int4-torch | int8-torch``).

Contract:

- :func:`from_gguf(gguf, config, quantization, device, progress)` builds the transformers model of ``config``
  (llama, mistral or qwen2) without allocating its float weights and fills it from the GGUF's tensors as they
  are stored: Q4_0 / Q4_1 become :class:`~specchat.backend.kernels.quant_linear.Int4Linear` with group 32 and
  the file's 4-bit codes unchanged (Q4_1's ``w = d·q + m`` is ``(q - 8)·d + (m + 8·d)``); the token embedding
  stays in its GGUF form when Q8_0 (:class:`Q8Embedding`, exact) and is float32 otherwise; the output head
  (the embedding when tied) is :class:`Int8Linear`, re-quantised per row from what the file stores (lossy:
  ``tests/backend/models/test_quantized.py`` bounds the error; ``benchmarks/RESULTS.md`` gives the measured
  figure); norms stay float32. Tensors of any other type (Q6_K, Q4_K, F16, ...) are de-quantised once and
  re-quantised: to int4 group 32 when the file stored 4 bits or fewer a weight, else to int8 per row; the
  returned notes say which tensors, for the load message. With ``int8-torch`` every linear layer is int8.
- Scales: int4 scales and zeros are rounded to bfloat16, the dtype the fast kernels take (relative error of
  a scale at most 2⁻⁹; measured on the embedded file in ``benchmarks/RESULTS.md``); ``exact_scales=True`` keeps
  them float32, which reproduces the file's weights bit for bit but runs the kernels' scalar loop (tests).
- With a ``skeleton.LightConfig`` (the compact forward will run the model) the model is
  ``skeleton.LightCausalLM``, no transformers modelling code imported; :func:`transformers_model` gives
  transformers' model over its tensors when a transformers forward is wanted.
- :func:`quantize_model(model, quantization, device)` does the same for a float model already loaded (hub and
  local sources): every ``nn.Linear`` of the decoder layers becomes int4 group 32 (or int8), the head int8.
- Progress: ``progress(message, fraction)`` once per decoder layer, with the fraction of layers done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels.decoder_layout import layout
from specchat.backend.kernels.quant_linear import Int4Linear, Int8Linear, Q8Embedding, quantize_int4
from specchat.backend.models.catalog.config import TORCH_QUANTIZATIONS as QUANTIZATIONS
from specchat.backend.models.gguf import gguf_file
from specchat.backend.models.gguf.gguf_file import GgufFile, GgufTensor
from specchat.backend.models.loading.skeleton import LightCausalLM, LightConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
GROUP_SIZE = 32
# ggml types with at most 4 bits a weight: re-quantised to int4 when they cannot be kept as they are.
_FOUR_BITS = {
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "IQ4_NL",
    "IQ4_XS",
    "IQ3_S",
    "IQ3_XXS",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
    "IQ1_S",
    "IQ1_M",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
}
_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
Progress = Callable[[str, "float | None"], None]


def compute_dtype(device: torch.device) -> torch.dtype:
    """The activation dtype of the quantised kernels (bfloat16: their vectorised paths)."""
    return torch.bfloat16


def _skeleton(config: Any) -> PreTrainedModel | LightCausalLM:
    """The model of ``config`` on the meta device: the light model for a ``skeleton.LightConfig`` (the compact
    forward will run it; no transformers modelling code is imported), else transformers' own."""
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"int4-torch / int8-torch loading from GGUF supports {', '.join(SUPPORTED_TYPES)} "
            f"models, not {getattr(config, 'model_type', None)!r}; use quantization: none"
        )
    if isinstance(config, LightConfig):
        return LightCausalLM(config)  # its tensors start on the meta device (computing on it imports torch._dynamo)
    return _transformers_skeleton(config)


def _transformers_skeleton(config: Any) -> PreTrainedModel:
    """transformers' model of ``config`` on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def _requantized(
    weight: torch.Tensor, bias: torch.Tensor | None, *, int4: bool, device: torch.device, scale_dtype: torch.dtype
) -> nn.Module:
    """A float ``weight`` as int4 group 32 (when ``int4`` and its width is a multiple of the group; scales and
    zeros in ``scale_dtype``), else as int8 per row (scales in the compute dtype)."""
    if int4 and weight.shape[1] % GROUP_SIZE == 0:
        codes, scale, zero = quantize_int4(weight, GROUP_SIZE)
        return Int4Linear.from_codes(
            codes, scale, zero, group_size=GROUP_SIZE, bias=bias, device=device, compute_dtype=scale_dtype
        )
    return Int8Linear.from_weight(weight, bias=bias, device=device, compute_dtype=compute_dtype(device))


class _Submodules(Protocol):
    """An ``nn.Module`` (or a model layout's decoder layer, which is one) as :func:`_set` walks it."""

    def get_submodule(self, target: str) -> nn.Module: ...


def _set(module: _Submodules, path: str, child: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(module.get_submodule(parent_path) if parent_path else module, name, child)


def _parameter(tensor: torch.Tensor, device: torch.device) -> nn.Parameter:
    return nn.Parameter(tensor.to(device=device, dtype=torch.float32), requires_grad=False)


class _Builder:
    """Turns GGUF tensors into modules; remembers what it had to re-quantise (for the load message)."""

    def __init__(self, gguf: GgufFile, quantization: str, device: torch.device, exact_scales: bool) -> None:
        self.gguf, self.quantization, self.device = gguf, quantization, device
        self.dtype = torch.float32 if exact_scales else compute_dtype(device)
        self.requantized: dict[str, int] = {}  # ggml type name -> tensors re-quantised from it
        self.heads = (int(gguf.field("attention.head_count", 0)), int(gguf.field("attention.head_count_kv", 0)))

    def tensor(self, name: str) -> GgufTensor:
        try:
            return self.gguf.tensors[name]
        except KeyError:
            raise ModelLoadError(
                f"{self.gguf.path}: tensor {name!r} is missing from the GGUF file; it does not "
                "look like a complete model of its architecture"
            ) from None

    def _row_order(self, name: str) -> torch.Tensor | None:
        if self.gguf.architecture != "llama" or not name.endswith((".attn_q.weight", ".attn_k.weight")):
            return None
        heads = self.heads[0] if ".attn_q." in name else (self.heads[1] or self.heads[0])
        return gguf_file.unpermute_rows(self.tensor(name).shape[0], heads)

    def linear(self, name: str, bias: torch.Tensor | None = None) -> nn.Module:
        tensor = self.tensor(name)
        order = self._row_order(name)
        if bias is not None and order is not None:
            bias = bias[order]
        if self.quantization == "int4-torch" and tensor.ggml_type in (gguf_file.Q4_0, gguf_file.Q4_1):
            codes, d, m = gguf_file.q4_blocks(tensor)
            if order is not None:
                codes, d, m = codes[order], d[order], m[order]
            return Int4Linear.from_codes(
                codes, d, m + 8 * d, group_size=GROUP_SIZE, bias=bias, device=self.device, compute_dtype=self.dtype
            )
        weight = gguf_file.dequantize(tensor)
        if order is not None:
            weight = weight[order]
        if tensor.ggml_type != gguf_file.F32 or self.quantization == "int4-torch":
            self.requantized[tensor.type_name] = self.requantized.get(tensor.type_name, 0) + 1
        return self.from_float(weight, bias, four_bits=tensor.type_name in _FOUR_BITS)

    def from_float(self, weight: torch.Tensor, bias: torch.Tensor | None, *, four_bits: bool) -> nn.Module:
        return _requantized(
            weight,
            bias,
            int4=self.quantization == "int4-torch" and four_bits,
            device=self.device,
            scale_dtype=self.dtype,
        )

    def vector(self, name: str) -> torch.Tensor:
        return gguf_file.dequantize(self.tensor(name)).reshape(-1)


def from_gguf(
    gguf: GgufFile,
    config: Any,
    quantization: str,
    device: torch.device,
    *,
    progress: Progress | None = None,
    exact_scales: bool = False,
) -> tuple[PreTrainedModel | LightCausalLM, list[str]]:
    """The quantised model of ``gguf`` and notes on tensors that were re-quantised (see the module docstring)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}")
    model = _skeleton(config)
    build = _Builder(gguf, quantization, device, exact_scales)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # packing is memory-bound; a second thread only waits when the cores are busy
    try:
        notes = _fill(model, build, config, progress)
    finally:
        torch.set_num_threads(threads)
    _return_freed_memory()
    return model, notes


def _return_freed_memory() -> None:
    """Give the loader's transient buffers (unpacked codes, the float head it re-quantises) back to the OS:
    glibc keeps freed heap pages resident otherwise (~30 MB for the embedded default)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _fill(model: nn.Module, build: _Builder, config: Any, progress: Progress | None) -> list[str]:
    gguf, quantization, device = build.gguf, build.quantization, build.device
    layers = int(config.num_hidden_layers)
    has_bias = "blk.0.attn_q.bias" in gguf.tensors
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for short, path in _LINEARS.items():
            bias_name = f"blk.{i}.{short}.bias"
            bias = build.vector(bias_name) if has_bias and bias_name in gguf.tensors else None
            _set(model, prefix + path, build.linear(f"blk.{i}.{short}.weight", bias))
        for short, path in _NORMS.items():
            model.get_submodule(prefix + path).weight = _parameter(build.vector(f"blk.{i}.{short}.weight"), device)
        if progress is not None:
            progress(f"Loading {gguf.path.name} as {quantization}", (i + 1) / layers)
    lm = layout(model)  # built by _skeleton: a supported family's layout
    lm.model.norm.weight = _parameter(build.vector("output_norm.weight"), device)
    embedding = build.tensor("token_embd.weight")
    # The embedding as the file stores it: kept in Q8_0 form, else its float weights.
    table: Q8Embedding | torch.Tensor
    if embedding.ggml_type == gguf_file.Q8_0:
        codes, d = gguf_file.q8_0_blocks(embedding)
        table = Q8Embedding(codes.to(device), d.to(device))
        lm.model.embed_tokens = table
    else:
        table = gguf_file.dequantize(embedding)
        lm.model.embed_tokens = nn.Embedding.from_pretrained(table.to(device), freeze=True)
    head = gguf.tensors.get("output.weight")
    dtype = compute_dtype(device)
    if head is not None:
        lm.lm_head = Int8Linear.from_weight(gguf_file.dequantize(head), device=device, compute_dtype=dtype)
    elif isinstance(table, torch.Tensor):  # tied to the float embedding
        lm.lm_head = Int8Linear.from_weight(table, device=device, compute_dtype=dtype)
    else:  # tied to the Q8_0 embedding: re-quantised a chunk of rows at a time
        lm.lm_head = Int8Linear.from_rows(
            table.dequantized, (table.num_embeddings, table.embedding_dim), device=device, compute_dtype=dtype
        )
    _finish(model, config, device)
    notes = [
        f"{count} {name} tensor(s) de-quantised and re-quantised to "
        f"{'int4 group 32 or int8' if quantization == 'int4-torch' else 'int8'}"
        for name, count in sorted(build.requantized.items())
    ]
    notes.append(f"output head re-quantised to int8 per row from {(head or embedding).type_name}")
    return notes


def _finish(model: nn.Module, config: Any, device: torch.device) -> None:
    """Real rotary buffers, no tying back to the float embedding, no tensor left on the meta device."""
    lm = layout(model)  # from _skeleton, filled by _fill or transformers_model
    rotary = lm.model.rotary_emb
    with torch.device(device):
        lm.model.rotary_emb = type(rotary)(config=config)
    lm.config.tie_word_embeddings = False  # the head is its own int8 copy now
    if hasattr(model, "_tied_weights_keys"):
        # nn.Module.__setattr__'s stub takes tensors and modules only; any value is set at run time
        model._tied_weights_keys = {} if isinstance(model._tied_weights_keys, dict) else []  # type: ignore[assignment]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type == "meta":
            raise ModelLoadError(
                f"{name} was not filled from the GGUF file (an unexpected tensor layout for "
                f"{config.model_type}); use quantization: none for this model"
            )
    model.eval()
    model.requires_grad_(False)


def transformers_model(model: PreTrainedModel | LightCausalLM) -> PreTrainedModel:
    """``model`` itself, or for a ``skeleton.LightCausalLM`` that :func:`from_gguf` filled, transformers' model of
    the same config holding its modules: the same tensors, none copied, run by transformers' forward (the
    light model has none)."""
    if not isinstance(model, LightCausalLM):
        return model
    light, config = model, model.config.to_transformers()
    model = _transformers_skeleton(config)
    lm, src = layout(model), layout(light)  # src: filled by from_gguf (its placeholders replaced)
    for mine, theirs in zip(lm.model.layers, src.model.layers, strict=True):
        for path in _LINEARS.values():
            _set(mine, path, theirs.get_submodule(path))
        for path in _NORMS.values():
            mine.get_submodule(path).weight = theirs.get_submodule(path).weight
    lm.model.embed_tokens = src.model.embed_tokens
    lm.model.norm.weight = src.model.norm.weight
    lm.lm_head = src.lm_head
    _finish(model, config, light.model.norm.weight.device)
    if light.generation_config is not None:  # the light loader's plain values (skeleton.generation_values)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(**light.generation_config)
    return model


def quantize_model(model: PreTrainedModel, quantization: str, device: torch.device) -> list[str]:
    """Replace a float model's decoder linears (int4 group 32 or int8) and its head (int8) in place."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}")
    dtype = compute_dtype(device)
    count = 0
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name, module in list(decoder.named_modules()):
        if type(module) is not nn.Linear:
            continue
        weight = module.weight.detach().float()
        bias = None if module.bias is None else module.bias.detach().float()
        _set(
            decoder,
            name,
            _requantized(weight, bias, int4=quantization == "int4-torch", device=device, scale_dtype=dtype),
        )
        count += 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        bias = None if head.bias is None else head.bias.detach().float()
        model.set_output_embeddings(
            Int8Linear.from_weight(head.weight.detach().float(), bias=bias, device=device, compute_dtype=dtype)
        )
        model.config.tie_word_embeddings = False
    return [f"{count} linear layers quantised to {quantization} while loading, the output head to int8 per row"]
