"""The compact forward's decoder layers in C++ (``native_pass.cpp``, ``native_attention.h``), built on this
machine and cached.

Why: a one-token pass of the embedded default makes ~1,300 ATen calls from Python (norms, projections,
rotary, attention, casts), and at ~5-10 µs of interpreter and argument parsing each that is as long as its
int4 kernels. ``native_pass.cpp`` runs a pass's decoder layers in one call: ATen's own calls for the int4
kernels, reductions and SiLU, loops doing the same float operation per element for the elementwise chains
between them (the Python loop's results bit for bit), and attention of its own (``native_attention.h``): each
query row over the keys it sees, read straight from the bfloat16 cache, with AVX2 where the CPU has it. That
attention sums in another order than ATen's, so the logits equal the Python loop's to rounding only (checked
within :data:`TOLERANCE`), but a pass's rows equal one-token passes bit for bit, as verification needs
(``tests/backend/kernels/test_native.py``). Measured on the embedded default: ``benchmarks/RESULTS.md``.

How: PyTorch ships its headers and libraries, so the only thing a machine needs is a C++ compiler (``CXX``,
else ``c++`` / ``g++`` / ``clang++``). The first time a model runs the compact forward, :func:`attach` starts
``python -m specchat.backend.kernels.native build`` in the background (``nice``d, ~20 s on two cores; it
finishes even if specchat exits first) and the model decodes through the Python loop meanwhile. The library
is cached in the cache directory under a name keyed by the sources, the flags, torch's version and the
platform; each later load attaches it in a background thread: load, bind the model's tensors once and
:func:`check` it on a scratch cache. The engine then switches to it between two requests
(:meth:`Attachment.adopt`), dropping the conversations cached until then, so no reply mixes the two paths.

It takes the passes :meth:`Native.takes` names (at most ``compact.ROWWISE_ROWS`` tokens in the cache it was
bound to: every plain decoding and verification pass, trees of drafts included unless a sliding window cuts
them); anything else (prefill) keeps the Python loop. A model whose projections are not all joined int4
layers (:func:`bindable`), or whose cache is neither bfloat16 nor float32, keeps it too. ``SPECCHAT_NATIVE=0``
turns it off. No compiler, a failed build or a failed check is logged once with the reason, and nothing else
changes.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from pathlib import Path

import torch

from specchat.backend.kernels import compact, native_build, switched_off
from specchat.backend.kernels.quant_linear import Int4Linear
from specchat.backend.kv import attention
from specchat.backend.kv.kv_cache import PagedKVCache, Sequence

log = logging.getLogger(__name__)

SWITCH = "SPECCHAT_NATIVE"
ADOPT_WAIT_S = 5.0  # the longest a request waits for the attach of a library already built (see adopt)
CLOSE_WAIT_S = 30.0  # the longest close() waits for an attach in its torch part (its check takes ~0.3 s)
_load_lock = threading.Lock()
_loaded: Path | None = None


def load(path: Path) -> None:
    """Load the built library into this process (once)."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            torch.ops.load_library(str(path))
            _loaded = path


def _cpu_int4(layer: compact._Layer) -> list[Int4Linear]:
    """Of the layer's projections qkv, o, gate_up and down (in that order), those that are int4 layers on CPU."""
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    return [p for p in projections if isinstance(p, Int4Linear) and p.packed.device.type == "cpu"]


def bindable(forward: compact.CompactForward) -> str | None:
    """None when every layer of the compact forward ``forward`` can run natively, else why not."""
    dtypes: set[torch.dtype] = set()
    for layer in forward.layers:
        projections = _cpu_int4(layer)
        if len(projections) < 4:
            return "projections other than joined int4 layers on CPU"
        dtypes.update(p.compute_dtype for p in projections)
    if len(dtypes) > 1:
        return f"projections in several dtypes ({', '.join(sorted(map(str, dtypes)))})"
    return None


class Native:
    """A compact forward's layers bound to the library and to one cache's K/V pools (one handle in C++)."""

    def __init__(self, forward: compact.CompactForward, cache: PagedKVCache, *, scalar: bool = False) -> None:
        """``forward``: one :func:`bindable` accepts."""
        tensors: list[torch.Tensor | None] = []
        ints: list[int] = []
        floats: list[float] = []
        for layer in forward.layers:
            tensors += [layer.norm1, layer.norm2]
            projections = _cpu_int4(layer)
            if len(projections) < 4:
                raise ValueError(f"the native layers cannot take this forward: {bindable(forward)}")
            for p in projections:
                tensors += [p.packed, p.scales_zeros, p.bias]
                ints.append(p.group_size)
            index = layer.attn.layer_idx
            tensors += [cache.k_layers[index], cache.v_layers[index]]
            ints += [
                layer.heads,
                layer.kv_heads,
                layer.head_dim,
                layer.inter,
                -1 if layer.window is None else layer.window,
            ]
            floats += [layer.eps1, layer.eps2, layer.scaling]
        self.cache = cache
        self.windows = [layer.window for layer in forward.layers]
        self.rows = compact.ROWWISE_ROWS  # the most tokens a pass it takes may have: the row-wise attention's
        self._ops = torch.ops.specchat_native
        # scalar: native_attention.h's portable loops even where its AVX2 version could run (tests compare them).
        dtype = _cpu_int4(forward.layers[0])[0].compute_dtype  # the joined qkv's: every projection's (bindable)
        self.handle = int(self._ops.prepare(tensors, ints, floats, dtype, scalar))

    def takes(self, n: int, ctx: attention.PagedContext) -> bool:
        """Whether it runs this pass: at most ``rows`` tokens in its cache, and a tree of drafts only where no
        layer's sliding window cuts the keys."""
        plan = ctx.plan
        if ctx.tree is not None and any(w is not None and w < plan.kv_len for w in self.windows):
            return False
        return (
            n <= self.rows and ctx.cache is self.cache and (plan.read_start is not None or plan.read_slots is not None)
        )

    def layers(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, ctx: attention.PagedContext) -> None:
        """Every decoder layer over the residual stream ``h`` [n, hidden] float32, in place."""
        plan = ctx.plan
        tree = [] if ctx.tree is None else compact.tree_keys(ctx.tree, plan.start, 0, None, h.device)
        run = plan.read_start is not None  # position p in slot read_start + p; else plan.read_slots[p]
        self._ops.layers(
            self.handle,
            h,
            cos,
            signed_sin,
            plan.start,
            plan.read_start if run else -1,
            plan.kv_len,
            None if run else plan.read_slots,
            tree,
        )

    def release(self) -> None:
        if self.handle >= 0:
            self._ops.release(self.handle)
            self.handle = -1


class Attachment:
    """The background attach of one compact forward (see the module docstring); :meth:`close` on unload."""

    def __init__(self, forward: compact.CompactForward, cache: PagedKVCache, name: str) -> None:
        self.forward, self.cache, self.name = forward, cache, name
        self.reason: str | None = None  # why it is not attached, once known
        self._closed = False
        self._ready: Native | None = None  # checked and bound, waiting for adopt()
        self.path = native_build.library_path()
        # Built before this load: then the attach is only the load and the check (~0.3 s), worth waiting for.
        self.prebuilt = self.path.exists()
        self._lock = threading.Lock()
        self._checking = threading.Event()  # set while the thread runs torch (load, check, bind)
        self._thread = threading.Thread(target=self._run, name=f"specchat-native-{name}", daemon=True)
        _live.add(self)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the attach to finish; whether the native layers are ready (adopted or waiting for adopt())."""
        self._thread.join(timeout)
        with self._lock:
            return self.forward.native is not None or self._ready is not None

    def _run(self) -> None:
        try:
            self.reason = self._attach()
        except Exception as exc:  # never let the fast path's failure reach the chat: the Python loop stays
            self.reason = f"{type(exc).__name__}: {exc}"
        if self.reason is not None:
            log.info("%s decodes through the compact forward's Python loop: %s", self.name, self.reason)

    def _attach(self) -> str | None:
        path = self.path
        if not path.exists():
            log.info("building the native decoder layers for this machine in the background (%s)", path)
            failed = native_build.build_in_background(path)
            if failed is not None:
                return failed
        with self._lock:
            if self._closed:
                return None
            self._checking.set()
        try:
            load(path)
            unfit = check(self.forward, self.cache)
            if unfit is not None:
                return f"the native layers failed their check ({unfit}), so they are not used"
            ready = Native(self.forward, self.cache)
        finally:
            self._checking.clear()
        with self._lock:
            if self._closed:
                ready.release()
                return None
            self._ready = ready
        log.info("%s will decode through the native layers from its next request (%s)", self.name, path.name)
        return None

    def adopt(self, wait_s: float = ADOPT_WAIT_S) -> bool:
        """Route the forward's passes through the native layers if they became ready since; True when this call
        switched them on. Called between requests only (the engine then drops its cached conversations), so a
        reply and the K/V it reuses come from one path: the two agree only to rounding, not bit for bit. With
        the library built before this load, it first waits up to ``wait_s`` for the attach to finish, so a
        first request sent right after loading (``specchat generate``) does not run all its reply through
        the Python loop; while a build runs it never waits."""
        if self.prebuilt:
            self._thread.join(wait_s)
        with self._lock:
            ready, self._ready = self._ready, None
            if ready is None or self._closed:
                return False
            self.forward.native = ready
            return True

    def close(self) -> None:
        """Stop using the native layers and release them. An attach in its torch part (load, check, bind) is
        waited for: torch's thread pool must not be torn down under it (at exit: "terminate called"); one still
        building is left to its child process, which outlives this one."""
        with self._lock:
            self._closed = True
            native, self.forward.native = self.forward.native, None
            ready, self._ready = self._ready, None
        if self._checking.is_set() and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)
        for held in (native, ready):
            if held is not None:
                held.release()
        _live.discard(self)


_live: weakref.WeakSet[Attachment] = weakref.WeakSet()  # attachments not closed yet


@atexit.register
def _close_all() -> None:
    """At interpreter exit (before daemon threads are stopped): close every attachment, so none is inside a
    torch operation when the process tears its thread pool down."""
    for attachment in list(_live):
        attachment.close()


def _pass(forward: compact.CompactForward, seq: Sequence, ids: torch.Tensor, native: Native | None) -> torch.Tensor:
    n = ids.numel()
    seq.reserve(n)
    plan = seq.plan(n)
    positions = torch.arange(plan.start, plan.kv_len)
    return forward.run(ids, positions, attention.PagedContext(seq.cache, plan), n, native)


# How far the native layers' logits may be from the Python loop's: their attention sums in another order, and
# bfloat16 projections after it turn last-bit differences into ~1% ones. Measured on the embedded default: up
# to 0.25 against a logit spread (standard deviation) of 3.1; a wrong kernel (a shifted key, a lost head) is
# off by the spread itself.
TOLERANCE = 0.2  # of the Python loop's logits' standard deviation


def check(forward: compact.CompactForward, cache: PagedKVCache) -> str | None:
    """None when the native layers are fit to use on this machine, else why not. On a scratch cache like
    ``cache``, after a 40-token prompt: a 4-token pass's rows must equal four one-token passes' bit for bit (so
    verification keeps exactly the tokens plain decoding picks), and its logits must be within TOLERANCE of the
    Python loop's."""
    first = forward.layers[0]
    scratch = PagedKVCache(
        num_layers=len(cache.k_layers),
        num_kv_heads=first.kv_heads,
        head_dim=first.head_dim,
        num_blocks=-(-44 // cache.block_size),  # the 44 tokens below, in blocks of the engine's size
        block_size=cache.block_size,
        dtype=cache.dtype,
        device="cpu",
    )
    probe = Native(forward, scratch)
    try:
        ids = torch.randint(0, forward.embed.num_embeddings, (44,), generator=torch.Generator().manual_seed(0))
        seq = scratch.new_sequence()
        _pass(forward, seq, ids[:40], None)
        seq.commit(40)
        python = _pass(forward, seq, ids[40:44], None)
        rows = _pass(forward, seq, ids[40:44], probe)
        ones = []
        for i in range(4):
            ones.append(_pass(forward, seq, ids[40 + i : 41 + i], probe))
            seq.commit(1)
        if not torch.equal(rows, torch.cat(ones)):
            return "a 4-token pass's rows differ from one-token passes' logits"
        spread = float(python.std())
        off = float((python - rows).abs().max())
        if not off <= TOLERANCE * spread:
            return f"their logits are {off:.3g} from the Python loop's (a spread of {spread:.3g})"
        return None
    finally:
        probe.release()


def attach(forward: compact.CompactForward, cache: PagedKVCache, name: str) -> Attachment | None:
    """Start attaching the native layers to ``forward`` (a compact forward over ``cache``), unless switched off
    or not bindable (logged); returns the attachment to wait on or close."""
    if switched_off(SWITCH):
        return None
    reason = bindable(forward)
    if reason is None and cache.dtype not in (torch.bfloat16, torch.float32):
        reason = f"a {cache.dtype} cache (bfloat16 or float32 only)"
    if reason is not None:
        log.info(
            "%s decodes through the compact forward's Python loop: the native layers do not cover %s", name, reason
        )
        return None
    return Attachment(forward, cache, name)


if __name__ == "__main__":  # the command docs/native.md gives; the build itself lives in native_build
    raise SystemExit(native_build.main(sys.argv[1:]))
