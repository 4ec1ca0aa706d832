"""The transformers baselines of `specchat bench`: `generate()` plain, with prompt lookup, and assisted.

These are what people would use instead of specchat, run the way they would run them: stock `generate()`,
``use_cache=True`` (transformers' DynamicCache), ``sdpa`` attention, greedy unless a temperature is given.

The baseline models share the engine's weights: :func:`sdpa_twin` makes a second module tree whose
parameters and buffers *are* the engine's tensors (no copy, so a 7B pair does not need twice the memory, and
both sides run bit-identical weights, dequantised GGUF included) but whose config selects ``sdpa`` instead of
specchat's paged attention. Sampling settings are explicit on both sides (no inherited top-k / repetition
penalty from a model's generation_config), so "greedy" means plain argmax everywhere.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from specchat.backend.kernels import cpu_linear
from specchat.backend.models.loading.native_loading import NativeCausalLM
from specchat.backend.models.loading.pair import load_model
from specchat.backend.models.loading.quantized import transformers_model

if TYPE_CHECKING:
    from specchat.backend.models.loading.skeleton import LightCausalLM

# transformers' own prompt-lookup setting that people use (issue 4 compares against this value).
HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass(slots=True)
class HFResult:
    token_ids: list[int]  # generated ids only (the prompt removed), EOS included when generation stopped on it
    wall_s: float  # the whole generate() call, prefill included
    ttft_s: float | None  # until the first generated token reached the streamer


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence generate()'s warnings while a baseline runs (assisted generation logs a deprecation per call;
    it breaks the progress bar and says nothing about speed); the previous verbosity comes back after."""
    import transformers

    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)


def sdpa_twin(model: PreTrainedModel | LightCausalLM) -> PreTrainedModel:
    """A second model object over the same parameter and buffer tensors, using transformers' sdpa attention.

    ``copy.deepcopy`` with a memo that maps every parameter and buffer to itself copies only the module tree
    and the config; quantised parameter classes (bitsandbytes Params4bit, with their quant state) are shared
    as they are. Layers the engine packed for oneDNN on CPU (cpu_linear.py) are stock ``nn.Linear`` again in
    the twin: the baseline runs transformers' own kernels. A light model (``backend/models/loading/skeleton.py``) is
    first put into transformers' model classes (``quantized.transformers_model``); for the CPU native model
    (``NativeCausalLM``) transformers' model of the same source is loaded as the spec would load without it.
    The twin gets a neutral generation_config so that generate() applies only what we pass.
    """
    if isinstance(model, NativeCausalLM):  # the C++ model has no transformers forward: load transformers' own
        if model.spec is None:
            raise ValueError("this native model was not loaded from a spec: there is no transformers model to load")
        model = load_model(model.spec, model.spec_device, attn_implementation="sdpa").model
    model = transformers_model(model)  # the light int4 model (skeleton.py) has no transformers forward of its own
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, memo)
    cpu_linear.unpack_linears(twin)  # stock nn.Linear kernels, as transformers runs them
    twin.set_attn_implementation("sdpa")
    twin.generation_config = GenerationConfig()
    twin.eval()
    return twin


class _FirstTokenClock(BaseStreamer):
    """Records when generate() pushes its first generated token (the first put() carries the prompt)."""

    def __init__(self, start: float, device: torch.device) -> None:
        self.start = start
        self.device = device
        self.calls = 0
        self.ttft_s: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.ttft_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def hf_generate(
    model: PreTrainedModel,
    prompt_ids: list[int],
    *,
    method: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    assistant: PreTrainedModel | None = None,
) -> HFResult:
    """One timed transformers ``generate()`` call.

    ``method``: "plain", "prompt-lookup" (``prompt_lookup_num_tokens=10``) or "assisted" (``assistant``, the
    draft twin, as ``assistant_model``). ``temperature`` 0 is greedy; otherwise pure temperature sampling
    (no top-k/top-p/penalty, matching the bench's specchat requests), seeded with ``seed``.
    """
    if method not in ("plain", "prompt-lookup", "assisted"):
        raise ValueError(f"unknown transformers method {method!r}")
    if method == "assisted" and assistant is None:
        raise ValueError("assisted generation needs the draft model")
    device = next(model.parameters()).device
    sampled = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=sampled,
        temperature=temperature if sampled else 1.0,
        top_k=0 if sampled else None,
        top_p=1.0,
        repetition_penalty=1.0,
        eos_token_id=list(eos_token_ids),
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    extra: dict = {}
    if method == "prompt-lookup":
        config.prompt_lookup_num_tokens = HF_PROMPT_LOOKUP_TOKENS
    elif method == "assisted":
        extra["assistant_model"] = assistant
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, prompt_len]
    attention_mask = torch.ones_like(input_ids)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    clock = _FirstTokenClock(start, device)
    with torch.inference_mode():
        # sdpa_twin's model is transformers' causal LM, whose class mixes generate() in
        out = cast(GenerationMixin, model).generate(
            input_ids, attention_mask=attention_mask, generation_config=config, streamer=clock, **extra
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    new = out[0, len(prompt_ids) :].tolist()
    return HFResult(token_ids=[int(t) for t in new], wall_s=wall, ttft_s=clock.ttft_s)
