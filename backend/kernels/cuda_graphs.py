"""Static-shape forwards over the paged cache, captured as CUDA graphs and replayed (eager on CPU).

Contract:
- :class:`GraphRunner` (one per model and :class:`PagedKVCache`) runs a forward over ``n`` new tokens of a
  sequence with every tensor shape fixed by two buckets: ``nb`` = the smallest of ``token_buckets`` >= ``n``
  (extra query rows are padding) and ``kvb`` = ``kv_len`` rounded up to a multiple of ``kv_step`` (extra key
  columns are masked). Per step only the values of static buffers change: input ids, positions, the slots
  the new tokens are written to, and the slots keys are gathered from (positions ``0 .. kvb-1`` in order).
  One host-to-device copy fills them; the causal / sliding-window masks are computed from the position
  buffer inside the forward, so nothing else moves.
- Logits: a shape keeps either one row (a draft step, a catch-up or prefill pass: the lm_head runs on the last
  real token only, picked by a static index) or all ``nb`` rows (a verification), keyed (nb, kvb, rows). Every
  shape writes its float32 logits into ONE static buffer of ``max_nb`` x vocab rows shared by all graphs, and
  :meth:`GraphRunner.try_forward` returns a copy of the rows asked for: no float32 logits per shape (for
  Qwen2.5-7B at an 8k context those were ~1.2 GB; :func:`static_bytes` is what stays, which
  ``backend/models/facts/memory.py`` counts).
- Padding is safe: padded tokens write their K/V into a *trash block* the runner takes from the pool for
  itself (never part of a sequence), sit at the last real position (so they see the same keys and never
  produce NaN rows), and their logits are dropped. Keys ``kv_len .. kvb-1`` are gathered from stale (valid)
  slot indices and masked out.
- On CUDA (``capture=True``) each (nb, kvb) shape is captured once, lazily, on first use (two warm-up runs on
  a side stream with trash slots, then capture; all graphs share one memory pool) and replayed afterwards.
  Without capture (CPU, or ``capture=False``) the same static forward runs eagerly: that is how CPU tests
  check the static path gives the normal paged path's logits.
- :meth:`GraphRunner.try_forward` returns None (the caller runs the normal eager path) when the step does
  not fit: ``n`` above the largest bucket, ``kv_len`` above ``max_kv``, another cache, or a capture that
  failed once (the runner then stays eager and says why in ``disabled_reason``).
- The model runner (``backend/engine/runner.py``) owns a :class:`GraphRunner` and offers it every step first;
  :func:`graphs_wanted` says whether it should make one (CUDA, and ``SPECCHAT_CUDA_GRAPHS`` not 0).

Host syncs: none here. The decode loop still has one per step, by design: the chosen token ids must reach the
host for the detokeniser, stop strings and the drafters (``int(argmax)`` / ``tolist()`` in engine/request.py,
verify.py and the draft-model drafter).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from specchat.backend.kv.attention import softcapped
from specchat.backend.kv.kv_cache import PagedKVCache, Sequence
from specchat.backend.limits import MAX_GAMMA

DEFAULT_TOKEN_BUCKETS = (1, 2, 4, 8, 16, MAX_GAMMA + 1)  # the largest: a verification at the largest γ
DEFAULT_KV_STEP = 256


def static_bytes(vocab: int, context: int, max_nb: int = DEFAULT_TOKEN_BUCKETS[-1]) -> int:
    """Bytes a runner keeps outside its graphs' memory pool: the shared float32 logits buffer and the step's
    index buffers (ids, positions, write slots, the kept row, and the read slots of ``context`` keys)."""
    return max_nb * vocab * 4 + (3 * max_nb + 1 + context + DEFAULT_KV_STEP) * 8


def graphs_wanted(device: torch.device) -> bool:
    """CUDA graphs for models on ``device``: CUDA only, off with ``SPECCHAT_CUDA_GRAPHS=0``."""
    return device.type == "cuda" and torch.cuda.is_available() and os.environ.get("SPECCHAT_CUDA_GRAPHS", "1") != "0"


class StaticContext:
    """The ``paged`` forward kwarg in static mode: every tensor has a fixed shape ``nb`` x ``kvb``.

    ``attention.paged_attention_forward`` hands each layer to :meth:`attend`. Masks are derived from the
    position buffer in the forward itself (recorded into a graph on capture), once per window size.
    """

    __slots__ = ("cache", "positions", "write_slots", "read_slots", "key_positions", "_masks")

    def __init__(
        self,
        cache: PagedKVCache,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> None:
        self.cache = cache
        self.positions = positions  # [nb] long: query positions (padding repeats the last real one)
        self.write_slots = write_slots  # [nb] long: where new K/V go (padding: the trash block)
        self.read_slots = read_slots  # [kvb] long: slot of key position j (stale beyond kv_len: masked)
        self.key_positions = key_positions  # [kvb] long: 0 .. kvb-1
        self._masks: dict[tuple[int | None, int], torch.Tensor] = {}

    def begin(self) -> None:
        """Forget the previous forward's masks (each forward derives them from the current positions)."""
        self._masks.clear()

    def allowed(self, window: int | None, rep: int) -> torch.Tensor:  # [rep * nb, kvb] bool
        """True where query row (r, i) may attend to key j: causal, within ``window``; repeated per KV group."""
        key = (window, rep)
        mask = self._masks.get(key)
        if mask is None:
            q = self.positions[:, None]
            k = self.key_positions[None, :]
            mask = k <= q
            if window is not None:
                mask = mask & (k > q - window)
            mask = mask.repeat(rep, 1) if rep > 1 else mask
            self._masks[key] = mask
        return mask

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """query [1, Hq, nb, D], key/value [1, Hkv, nb, D] -> [1, nb, Hq, D]."""
        cache = self.cache
        k_pool, v_pool = cache.k_layers[layer], cache.v_layers[layer]
        k_pool.index_copy_(2, self.write_slots, key.to(cache.dtype))
        v_pool.index_copy_(2, self.write_slots, value.to(cache.dtype))
        k = k_pool.index_select(2, self.read_slots)  # [1, Hkv, kvb, D]
        v = v_pool.index_select(2, self.read_slots)
        if k.dtype != query.dtype:
            k, v = k.to(query.dtype), v.to(query.dtype)
        _, hq, nb, d = query.shape
        hkv = k.shape[1]
        rep = hq // hkv
        # Query head h uses KV head h // rep: fold the rep query heads of a group into rows so the KV heads
        # are never expanded (no copy of K/V beyond the gather) and every SDPA backend accepts the shapes.
        if softcap is not None:  # the paged path's own softcapped attention, with the static mask
            return softcapped(query, k, v, ~self.allowed(window, 1), scaling, softcap).transpose(1, 2)
        q = query.reshape(1, hkv, rep * nb, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed(window, rep), scale=scaling)
        return out.view(1, hq, nb, d).transpose(1, 2)


class _Shape:
    """One (nb, kvb, rows) static forward: its context, how many logits rows it keeps and (on CUDA) graph."""

    __slots__ = ("ctx", "rows", "graph")

    def __init__(self, ctx: StaticContext, rows: int) -> None:
        self.ctx = ctx
        self.rows = rows  # 1: the last real token's row only; nb: every row
        self.graph: torch.cuda.CUDAGraph | None = None


class CausalLM(Protocol):
    """What the graph runner uses of a model: transformers' causal LM interface."""

    config: Any

    def get_output_embeddings(self) -> nn.Module | None: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...  # the forward: an output with .logits


class GraphRunner:
    """Static-shape forwards of ``model`` over ``cache``; see the module docstring for the rules."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        *,
        token_buckets: Iterable[int] = DEFAULT_TOKEN_BUCKETS,
        kv_step: int = DEFAULT_KV_STEP,
        max_kv: int | None = None,
        capture: bool | None = None,
    ) -> None:
        buckets = tuple(sorted(set(int(b) for b in token_buckets)))
        if not buckets or buckets[0] < 1 or kv_step < 1:
            raise ValueError(f"GraphRunner: token_buckets {token_buckets!r} must be >= 1 and kv_step {kv_step} >= 1")
        self.model, self.cache = model, cache
        self.buckets, self.kv_step = buckets, kv_step
        self.max_nb = buckets[-1]
        limit = max_kv if max_kv is not None else cache.num_slots
        self.max_kv = -(-limit // kv_step) * kv_step
        on_cuda = cache.device.type == "cuda" and torch.cuda.is_available()
        self.capture = on_cuda if capture is None else bool(capture) and on_cuda
        (trash_block,) = cache.pool.allocate(1)  # never in any sequence: padded tokens write here
        self.trash_block: int | None = trash_block
        self.trash_slot = trash_block * cache.block_size
        dev = cache.device
        size = 3 * self.max_nb + 1 + self.max_kv
        # One device buffer holds every per-step value (views below), so one copy fills a step.
        self._dev = torch.zeros(size, dtype=torch.long, device=dev)
        # Pinned on CUDA: the step's copy is asynchronous (a pageable copy synchronises the stream). The event
        # marks when the last copy has read it, before it is rewritten (in the decode loop it long has).
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None
        nbm = self.max_nb
        self.input_ids = self._dev[:nbm]  # [max_nb]
        self.positions = self._dev[nbm : 2 * nbm]  # [max_nb]
        self.write_slots = self._dev[2 * nbm : 3 * nbm]  # [max_nb]
        self.keep_row = self._dev[3 * nbm : 3 * nbm + 1]  # [1] the last real token's row (one-row shapes)
        self.read_slots = self._dev[3 * nbm + 1 :]  # [max_kv]
        head = model.get_output_embeddings()
        # the output rows: the head's (a linear layer: its weight is a tensor), else the config's vocabulary
        vocab = (
            cast(torch.Tensor, head.weight).shape[0] if head is not None else model.config.get_text_config().vocab_size
        )
        self._logits = torch.zeros(nbm, vocab, dtype=torch.float32, device=dev)  # every shape's output
        self._key_positions = torch.arange(self.max_kv, dtype=torch.long, device=dev)
        self._arange = torch.arange(nbm, dtype=torch.long)
        self._slots_key: tuple[int, tuple[int, ...]] | None = None  # (id of the sequence, its block table)
        self._slots_host: torch.Tensor | None = None
        self._shapes: dict[tuple[int, int, int], _Shape] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.disabled_reason: str | None = None
        self.stats = {"replays": 0, "eager_static": 0, "captures": 0, "fallbacks": 0}

    # -- buckets ------------------------------------------------------------------------------------------

    def token_bucket(self, n: int) -> int | None:
        """The smallest bucket >= n, or None when n is above the largest."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def kv_bucket(self, kv_len: int) -> int | None:
        kvb = -(-kv_len // self.kv_step) * self.kv_step
        return kvb if kvb <= self.max_kv else None

    def fits(self, seq: Sequence, n: int) -> bool:
        return (
            self.disabled_reason is None
            and seq.cache is self.cache
            and self.token_bucket(n) is not None
            and self.kv_bucket(seq.length + n) is not None
        )

    # -- one step -----------------------------------------------------------------------------------------

    def _slot_table(self, seq: Sequence) -> torch.Tensor:  # [capacity] long, host
        """Slot of every reserved position of ``seq``; rebuilt only when its block table changed."""
        key = (id(seq), tuple(seq.block_table))
        if key != self._slots_key:
            bs = self.cache.block_size
            table = torch.tensor(seq.block_table, dtype=torch.long)
            self._slots_host = (table[:, None] * bs + torch.arange(bs)).flatten()
            self._slots_key = key
        assert self._slots_host is not None  # set with the key above, the first time and every change
        return self._slots_host

    def _fill(self, seq: Sequence, ids: torch.Tensor | list[int], n: int, nb: int) -> None:
        start, kv_len = seq.length, seq.length + n
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        slots = self._slot_table(seq)
        h, m = self._host, self.max_nb
        device_ids = ids if isinstance(ids, torch.Tensor) and ids.device.type != "cpu" else None
        if device_ids is None:
            h[:n] = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
        h[n:nb] = 0
        h[m : m + nb] = (self._arange[:nb] + start).clamp_(max=kv_len - 1)
        h[2 * m : 2 * m + n] = slots[start:kv_len]
        h[2 * m + n : 2 * m + nb] = self.trash_slot
        h[3 * m] = n - 1
        h[3 * m + 1 : 3 * m + 1 + kv_len] = slots[:kv_len]
        end = 3 * m + 1 + kv_len
        self._dev[:end].copy_(h[:end], non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
        if device_ids is not None:
            self.input_ids[:n].copy_(device_ids)

    def _context(self, nb: int, kvb: int) -> StaticContext:
        return StaticContext(
            self.cache, self.positions[:nb], self.write_slots[:nb], self.read_slots[:kvb], self._key_positions[:kvb]
        )

    def _run(self, shape: _Shape, nb: int) -> None:
        """The forward; its logits rows land in the shared buffer (rows 0 .. shape.rows - 1)."""
        shape.ctx.begin()
        keep = self.keep_row if shape.rows == 1 and nb > 1 else 0
        out = self.model(
            input_ids=self.input_ids[:nb][None],
            position_ids=self.positions[:nb][None],
            use_cache=False,
            paged=shape.ctx,
            logits_to_keep=keep,
        )
        self._logits[: shape.rows].copy_(out.logits[0])

    def _capture(self, shape: _Shape, nb: int) -> None:
        """Warm up on a side stream (writes go to the trash block), then record the forward."""
        m = self.max_nb
        with torch.inference_mode():
            self._dev[2 * m : 3 * m].fill_(self.trash_slot)
            self._dev[m : 2 * m].zero_()
            self.keep_row.zero_()
            self.read_slots.fill_(self.trash_slot)
            stream = torch.cuda.Stream(device=self.cache.device)
            stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._run(shape, nb)
            torch.cuda.current_stream(self.cache.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._run(shape, nb)
        shape.graph = graph
        self.stats["captures"] += 1

    def try_forward(
        self, seq: Sequence, input_ids: list[int] | torch.Tensor, logits_to_keep: int = 1
    ) -> torch.Tensor | None:  # [logits_to_keep, vocab] float, or None: run the eager path
        """The static forward of the model runner (same contract: reserves, writes, does not commit)."""
        n = input_ids.numel() if isinstance(input_ids, torch.Tensor) else len(input_ids)
        if n < 1 or not self.fits(seq, n):
            self.stats["fallbacks"] += 1
            return None
        nb, kvb = self.token_bucket(n), self.kv_bucket(seq.length + n)
        assert nb is not None and kvb is not None  # fits() checked both
        rows = 1 if logits_to_keep == 1 else nb
        seq.reserve(n)
        key = (nb, kvb, rows)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape(self._context(nb, kvb), rows)
            if self.capture:
                try:
                    self._capture(shape, nb)
                except Exception as error:  # an op that cannot be captured: stay eager for good, say why
                    del self._shapes[key]
                    self.disabled_reason = f"CUDA graph capture failed ({type(error).__name__}: {error})"
                    self.stats["fallbacks"] += 1
                    return None
        ids = input_ids.reshape(-1) if isinstance(input_ids, torch.Tensor) else input_ids
        self._fill(seq, ids, n, nb)
        if shape.graph is not None:
            shape.graph.replay()
            self.stats["replays"] += 1
        else:
            with torch.inference_mode():
                self._run(shape, nb)
            self.stats["eager_static"] += 1
        # A copy of the kept rows: the shared output is overwritten by the next forward.
        if rows == 1:
            return self._logits[:1].clone()
        return self._logits[n - logits_to_keep : n].clone()

    def release(self) -> None:
        """Drop the graphs and give the trash block back to the pool."""
        self._shapes.clear()
        if self.trash_block is not None:
            self.cache.pool.free(self.trash_block)
            self.trash_block = None
        self.disabled_reason = "released"
