"""The model runner: the one place that decides how a model's forward over the paged cache runs.

Contract:
- :class:`ModelRunner` takes a loaded model, sizes its :class:`~specchat.backend.kv.kv_cache.PagedKVCache` and
  chooses its :class:`~specchat.backend.engine.forward_paths.ForwardPath` once (``forward_paths.py`` lists them).
  On CPU the native model (the whole pass in C++ on the file's own blocks) runs whenever the library is usable
  here and the architecture is covered; that choice is made when the model loads
  (``backend/models/loading/native_loading.py``: it decides how the weights are read), and a model loaded for it
  is a ``NativeCausalLM``, which has no other path. Otherwise the model is switched to paged attention
  (``backend/kv/attention.py``) and runs CUDA graphs on CUDA (``SPECCHAT_CUDA_GRAPHS=0`` turns them off); on CPU
  the compact int4 loop for a model with int4/int8 layers (the path of a machine without a C++ compiler;
  ``SPECCHAT_COMPACT=0`` turns it off, and an architecture it does not cover keeps transformers' forward); else
  transformers' forward, with oneDNN-packed linear layers for a float32 model on CPU when their second copy fits
  in free memory (``SPECCHAT_CPU_PACKED=0`` turns that off). A light model (``backend/models/loading/skeleton.py``,
  loaded for the compact loop) has no other path: without it the runner raises :class:`ModelLoadError`.
- :attr:`ModelRunner.start_line` names the path in one line ("CPU native (avx2), Q4_1, Q8_0 as stored"; on a fallback,
  why the native model does not run, the line the UI, ``generate`` and ``serve`` show).
- :meth:`ModelRunner.forward` is the one dispatch point: one forward of the chosen path, a
  :class:`~specchat.backend.engine.forward_paths.Pass` (logits, and the hidden-state taps asked for).
- :meth:`ModelRunner.forward_batch` runs several sequences' passes (each a ``PassPart``) together, one ``Pass``
  each, what ``forward`` gives it alone: one pass over all their rows on the native path, one forward each on
  the others (continuous batching: backend/engine/batch.py).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from specchat.backend.engine.forward_paths import (
    CompactPath,
    EagerPath,
    ForwardPath,
    GraphPath,
    NativePath,
    Pass,
    Taps,
    check_taps,
    checked_ids,
    forward_paged,
)
from specchat.backend.errors import ModelLoadError
from specchat.backend.kernels import compact, cpu_linear, cuda_graphs, native, quant_linear, switched_off
from specchat.backend.kernels.native_model import NativeModel, PassPart
from specchat.backend.kv import attention
from specchat.backend.kv.block_pool import KVCacheUsageError
from specchat.backend.kv.kv_cache import PagedKVCache, Sequence
from specchat.backend.limits import KV_BLOCK_SIZE, MAX_GAMMA, NATIVE_PREFILL_CHUNK, PREFILL_CHUNK
from specchat.backend.models.facts.memory import format_bytes, free_memory
from specchat.backend.models.loading.native_loading import NativeCausalLM
from specchat.backend.models.loading.pair import LoadedModel
from specchat.backend.models.loading.skeleton import LightCausalLM

PACKING_SPARE_BYTES = 512 * 2**20  # free memory left after packing (activations of a prefill chunk, the UI)

log = logging.getLogger(__name__)


class ModelRunner:
    """One model with its paged cache and its chosen forward path (see the module docstring).

    ``kv_tokens`` sizes the cache (the engine passes the context length plus room for a verification step), the
    longest sequence a pass reads; ``kept_tokens`` more slots hold sequences kept between requests (the engine's
    prefix cache), so the pool grows by them while a pass's key length (the CUDA graphs' buckets) does not.
    """

    def __init__(self, loaded: LoadedModel, *, kv_tokens: int, kept_tokens: int = 0) -> None:
        model = loaded.model
        self.loaded = loaded
        self.taps_required = False  # require_taps(): a draft head reads hidden states from every pass
        self.graphs: cuda_graphs.GraphRunner | None = None
        if isinstance(model, NativeCausalLM):  # the whole pass in C++: nothing of transformers is involved
            self.cache = self._cache(kv_tokens + kept_tokens)
            model.native.bind(self.cache)
            self.forward_path: ForwardPath = NativePath(model, model.native)
            return
        attention.check_supported(model.config)
        light = isinstance(model, LightCausalLM)  # its config names the paged attention; registering it with
        # transformers would import transformers' modelling code, which only a transformers forward needs
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION if light else attention.register())
        model.eval()
        wants_graphs = cuda_graphs.graphs_wanted(loaded.device)
        # The graph runner keeps one block of its own for the K/V of padded tokens.
        self.cache = self._cache(kv_tokens + kept_tokens + (KV_BLOCK_SIZE if wants_graphs else 0))
        fast = None
        if wants_graphs:
            self.graphs = cuda_graphs.GraphRunner(model, self.cache, max_kv=kv_tokens)
            self.forward_path = GraphPath(model, self.graphs)
        elif loaded.device.type == "cpu" and quant_linear.quantized_layers(model):
            fast = _compact_forward(loaded)
            self.forward_path = CompactPath(model, fast) if fast is not None else EagerPath(model)
        else:
            packed = _pack_if_it_fits(loaded) if loaded.device.type == "cpu" else 0
            self.forward_path = EagerPath(model, packed)
        if light and fast is None:
            raise ModelLoadError(
                f"{loaded.spec.source} was loaded for the compact forward on CPU, which is not "
                f"available now (SPECCHAT_COMPACT={os.environ.get('SPECCHAT_COMPACT', '')!r}, device "
                f"{loaded.device}); load the model again in this setting"
            )

    def _cache(self, max_tokens: int) -> PagedKVCache:
        loaded = self.loaded
        return PagedKVCache.for_model(
            loaded.model.config,
            max_tokens=max_tokens,
            block_size=KV_BLOCK_SIZE,
            dtype=loaded.dtype,
            device=loaded.device,
        )

    @property
    def model(self):
        return self.loaded.model

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def native(self) -> NativeModel | None:
        """The native model, where it is the path (its profile counters: ``specchat bench --profile``)."""
        return self.forward_path.native if isinstance(self.forward_path, NativePath) else None

    @property
    def path(self) -> str:
        """The forward path in use: "cpu-native", "cuda-graphs", "cpu-compact", "cpu-packed" or "eager"."""
        return self.forward_path.name

    @property
    def exact_rows(self) -> int:
        """The most tokens a pass may hold with every row's logits what a one-token pass gives, bit for bit:
        the compact forward's row-wise attention (and its C++ layers) take ``compact.ROWWISE_ROWS``; the CUDA
        graphs' largest bucket and the eager paths are held to ``MAX_GAMMA + 1`` (what they are tested at)."""
        return compact.ROWWISE_ROWS if self.path == "cpu-compact" else MAX_GAMMA + 1

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill pass on this path (``limits.NATIVE_PREFILL_CHUNK`` on the native model)."""
        return NATIVE_PREFILL_CHUNK if self.path == "cpu-native" else PREFILL_CHUNK

    def forward(
        self,
        seq: Sequence,
        input_ids: list[int] | torch.Tensor,
        *,
        logits_to_keep: int = 1,
        parents: list[int] | None = None,
        cancel: threading.Event | None = None,
        taps: Taps | None = None,
    ) -> Pass:
        """One forward over ``input_ids`` after ``seq``'s committed tokens (reserves, writes, never commits);
        ``parents``: a tree of drafts; ``cancel``: stop between layers once set; ``taps``: hidden states to return
        too (see ``forward_paths.py``)."""
        return forward_paged(
            self.forward_path,
            seq,
            input_ids,
            logits_to_keep=logits_to_keep,
            parents=parents,
            cancel=cancel,
            taps=taps,
            config=self.model.config,
        )

    def forward_batch(self, parts: list[PassPart], taps: Taps | None = None) -> list[Pass]:
        """Several sequences' passes at once (see the module docstring); ``offset`` (a pass in pieces): native only."""
        if taps is not None:
            check_taps(taps, self.model.config)
        for part in parts:
            checked_ids(part.seq, part.ids, part.keep, part.parents)
        if isinstance(self.forward_path, NativePath):
            return self.forward_path.run_batch(parts, taps)
        if any(part.offset for part in parts):
            raise KVCacheUsageError(f"a pass in pieces needs the CPU native model; this model runs {self.path}")
        return [self.forward(p.seq, p.ids, logits_to_keep=p.keep, parents=p.parents, taps=taps) for p in parts]

    def require_taps(self) -> bool:
        """Every pass of this runner may ask for taps from now on (a draft head reads them). Every path returns
        them from the pass it would run anyway (the native model, the compact loop, transformers; CUDA graphs
        stay for passes without taps, whose result is the eager forward's), so nothing cached is dropped: False."""
        self.taps_required = True
        return False

    @property
    def start_line(self) -> str:
        """The path in one line (see the module docstring)."""
        model, reason = self.loaded.model, self.loaded.native_reason
        if isinstance(model, NativeCausalLM):
            return f"CPU native ({native.isa()}), {model.description}"
        if self.path == "cuda-graphs":
            return f"CUDA graphs on {self.device}"
        where = {
            "cpu-compact": "CPU int4 Python loop",
            "cpu-packed": "CPU transformers forward (oneDNN-packed)",
        }.get(self.path, f"transformers forward on {self.device}")
        return f"{where}: {reason}" if reason else where

    def close(self) -> None:
        """Release the CUDA graphs (their memory pool) and their block."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None


def _pack_if_it_fits(loaded: LoadedModel) -> int:
    """On CPU, pack the linear layers for oneDNN when their second copy fits in free memory with room to spare
    for a prefill's activations; otherwise decode with the default kernels, and log why. Returns layers packed."""
    need = cpu_linear.packed_bytes(loaded.model)
    if not need:
        return 0
    free = free_memory(torch.device("cpu"))
    if need + PACKING_SPARE_BYTES > free:
        log.info(
            "not packing %s's linear layers for oneDNN: %s needed, %s free",
            loaded.spec.source,
            format_bytes(need),
            format_bytes(free),
        )
        return 0
    count = cpu_linear.pack_linears(loaded.model)
    if count:
        log.info("packed %d linear layers of %s for oneDNN (%s)", count, loaded.spec.source, format_bytes(need))
    return count


def _compact_forward(loaded: LoadedModel) -> compact.CompactForward | None:
    """The compact forward of a quantised model on CPU, unless switched off or its architecture is not covered."""
    if switched_off("SPECCHAT_COMPACT"):
        return None
    try:
        return compact.build(loaded.model)
    except compact.Unsupported as reason:
        log.info("%s runs transformers' forward: the compact forward does not cover %s", loaded.spec.source, reason)
        return None
