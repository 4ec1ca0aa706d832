"""The compact forward's decoder layers in C++ (``native_pass.cpp``), built on this machine and cached.

Why: a one-token pass of the embedded default makes ~1,300 ATen calls from Python (norms, projections,
rotary, attention, casts), and at ~5-10 µs of interpreter and argument parsing each that is as long as its
int4 kernels. ``native_pass.cpp`` runs the same operations, in the same order, on the same tensors from C++ in
one call per pass (ATen's own calls for the kernels, reductions, matrix products, softmax and SiLU; loops doing
the same float operation per element for the elementwise chains between them), so its logits are the Python
loop's bit for bit (``tests/backend/kernels/test_native.py``). Measured on the embedded default (README "Speed
on CPU"): a one-token pass 0.74x the Python loop's time, ~4 ms around the kernels instead of ~10.

How: PyTorch ships its headers and libraries, so the only thing a machine needs is a C++ compiler (``CXX``,
else ``c++`` / ``g++`` / ``clang++``). The first time a model runs the compact forward, :func:`attach` starts
``python -m specchat.backend.kernels.native build`` in the background (``nice``d, ~20 s on two cores; it
finishes even if specchat exits first) and the model decodes through the Python loop meanwhile. The library
is cached in the cache directory under a name keyed by the source, torch's version and the platform; each
later load attaches it in a background thread: load, bind the model's tensors once, check on a scratch cache
that a few passes give exactly the Python loop's logits, and only then route passes through it.

It takes the passes :meth:`Native.takes` names (at most ``compact.ROWWISE_ROWS`` tokens, the slots one
consecutive run: every plain decoding and verification pass of a chat whose blocks were allocated in order,
trees of drafts included unless a sliding window cuts them); anything else keeps the Python loop. A model
whose projections are not all joined int4 layers (:func:`bindable`) keeps it too. ``SPECCHAT_NATIVE=0`` turns
it off. No compiler, a failed build or a failed check is logged once with the reason, and nothing else changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from specchat.backend.kernels import compact, switched_off
from specchat.backend.kernels.quant_linear import Int4Linear
from specchat.backend.kv import attention
from specchat.backend.kv.kv_cache import PagedKVCache
from specchat.backend.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_pass.cpp")
SWITCH = "SPECCHAT_NATIVE"
BUILD_TIMEOUT_S = 600
_load_lock = threading.Lock()
_loaded: Path | None = None


FLAGS = ("-O2", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC", "-w")  # no fused multiply-adds: see the .cpp


def _key() -> str:
    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(),
             str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), sys.platform.encode(), platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def library_path() -> Path:
    """Where this source, built for this torch and platform, is cached."""
    return cache_dir() / "native" / f"specchat_native-{_key()}.so"


def compiler() -> str | None:
    """The C++ compiler a build would use: ``CXX`` if set, else the first of c++, g++, clang++ on PATH."""
    chosen = os.environ.get("CXX", "").strip()
    if chosen:
        return shutil.which(chosen) or chosen
    return next((found for name in ("c++", "g++", "clang++") if (found := shutil.which(name))), None)


def build_command(cxx: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    return [cxx, *FLAGS,
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE), "-o", str(out),
            *(f"-L{p}" for p in libs), "-lc10", "-ltorch_cpu", *(f"-Wl,-rpath,{p}" for p in libs)]


NO_COMPILER = "no C++ compiler found (set CXX, or install g++ or clang++)"
BUSY = "another specchat process is building it"
BUSY_EXIT = 3  # the build command's exit status when another process holds the build lock


def _failure_note(out: Path) -> Path:
    return out.with_suffix(".failed")


def _lock(out: Path) -> Path:
    return out.with_name(out.name + ".building")


def _building(out: Path) -> bool:
    """Whether another process holds the build lock of ``out`` (taken less than BUILD_TIMEOUT_S ago)."""
    try:
        return time.time() - _lock(out).stat().st_mtime < BUILD_TIMEOUT_S
    except OSError:
        return False


def _take_lock(out: Path) -> bool:
    """Take the build lock of ``out`` (one build at a time, across processes); False while another holds it.
    A lock older than BUILD_TIMEOUT_S belonged to a build that died: it is taken over."""
    lock = _lock(out)
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            if _building(out):
                return False
            lock.unlink(missing_ok=True)
    return False


def build(out: Path | None = None) -> str | None:
    """Compile the library into ``out`` (default :func:`library_path`), atomically; None when built, else why
    not (:data:`BUSY` while another process builds it). A failed compile is noted beside ``out`` with the
    compiler's message, so later starts do not retry it with the same compiler."""
    out = out or library_path()
    cxx = compiler()
    if cxx is None:
        return NO_COMPILER
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not _take_lock(out):
            return BUSY
    except OSError as exc:
        return f"cannot write the cache folder {out.parent}: {exc}"
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        try:
            done = subprocess.run(build_command(cxx, partial), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason = f"{cxx} did not run: {exc}"
        else:
            if done.returncode == 0 and partial.exists():
                os.replace(partial, out)
                _failure_note(out).unlink(missing_ok=True)
                return None
            reason = f"{cxx} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}"
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            _failure_note(out).write_text(f"{cxx}\n{reason}\n")
        return reason
    finally:
        _lock(out).unlink(missing_ok=True)


def _earlier_failure(out: Path) -> str | None:
    """The noted reason a build with the current compiler failed before, if it did."""
    try:
        cxx, _, reason = _failure_note(out).read_text().partition("\n")
    except OSError:
        return None
    return reason.strip() if cxx == (compiler() or "") else None


def _wait_for(out: Path, wait_s: float) -> str | None:
    """Wait while another process builds ``out``; None once it exists."""
    deadline = time.monotonic() + wait_s
    while not out.exists() and _building(out) and time.monotonic() < deadline:
        time.sleep(0.5)
    return None if out.exists() else "another specchat process's build did not finish"


def _build_in_background(out: Path, wait_s: float = BUILD_TIMEOUT_S) -> str | None:
    """Run :func:`build` in a ``nice``d child process that outlives this one, or wait for another process's
    build of the same library (several specchat processes started at once compile it once). None when built."""
    if compiler() is None:
        return NO_COMPILER
    earlier = _earlier_failure(out)
    if earlier is not None:
        return f"an earlier build failed ({earlier}); delete {_failure_note(out)} to try again"
    if _building(out):
        return _wait_for(out, wait_s)
    nice = (lambda: os.nice(19)) if hasattr(os, "nice") else None
    child = subprocess.Popen([sys.executable, "-m", "specchat.backend.kernels.native", "build", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=nice)
    _, err = child.communicate()
    if child.returncode == 0 and out.exists():
        return None
    if child.returncode == BUSY_EXIT:
        return _wait_for(out, wait_s)
    return err.strip()[-1500:] or f"the build exited with {child.returncode}"


def load(path: Path) -> None:
    """Load the built library into this process (once)."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            torch.ops.load_library(str(path))
            _loaded = path


def bindable(forward) -> str | None:
    """None when every layer of the compact forward ``forward`` can run natively, else why not."""
    dtypes = set()
    for layer in forward.layers:
        projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if not all(isinstance(p, Int4Linear) and p.packed.device.type == "cpu" for p in projections):
            return "projections other than joined int4 layers on CPU"
        dtypes.update(p.compute_dtype for p in projections)
    if len(dtypes) > 1:
        return f"projections in several dtypes ({', '.join(sorted(map(str, dtypes)))})"
    return None


class Native:
    """A compact forward's layers bound to the library and to one cache's K/V pools (one handle in C++)."""

    def __init__(self, forward, cache) -> None:
        tensors: list[torch.Tensor | None] = []
        ints: list[int] = []
        floats: list[float] = []
        for layer in forward.layers:
            tensors += [layer.norm1, layer.norm2]
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                tensors += [p.packed, p.scales_zeros, p.bias]
                ints.append(p.group_size)
            index = layer.attn.layer_idx
            tensors += [cache.k_layers[index], cache.v_layers[index]]
            ints += [layer.heads, layer.kv_heads, layer.head_dim, layer.inter,
                     -1 if layer.window is None else layer.window]
            floats += [layer.eps1, layer.eps2, layer.scaling]
        self.cache = cache
        self.windows = [layer.window for layer in forward.layers]
        self.rows = compact.ROWWISE_ROWS  # the most tokens a pass it takes may have: the row-wise attention's
        self._ops = torch.ops.specchat_native
        self.handle = int(self._ops.prepare(tensors, ints, floats, forward.layers[0].qkv.compute_dtype))

    def takes(self, n: int, ctx) -> bool:
        """Whether it runs this pass: at most ``rows`` tokens over one consecutive run of slots in its cache,
        and a tree of drafts only where no layer's sliding window cuts the keys."""
        plan = ctx.plan
        if ctx.tree is not None and any(w is not None and w < plan.kv_len for w in self.windows):
            return False
        return (n <= self.rows and ctx.cache is self.cache and plan.write_start is not None
                and plan.read_start is not None)

    def layers(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, ctx) -> None:
        """Every decoder layer over the residual stream ``h`` [n, hidden] float32, in place."""
        plan = ctx.plan
        tree = [] if ctx.tree is None else compact.tree_keys(ctx.tree, plan.start, 0, None, h.device)
        self._ops.layers(self.handle, h, cos, signed_sin, plan.start, plan.write_start, plan.read_start, plan.kv_len,
                         tree)

    def release(self) -> None:
        if self.handle >= 0:
            self._ops.release(self.handle)
            self.handle = -1


class Attachment:
    """The background attach of one compact forward (see the module docstring); :meth:`close` on unload."""

    def __init__(self, forward, cache, name: str) -> None:
        self.forward, self.cache, self.name = forward, cache, name
        self.reason: str | None = None  # why it is not attached, once known
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"specchat-native-{name}", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the attach to finish; whether the forward now runs natively."""
        self._thread.join(timeout)
        return self.forward.native is not None

    def _run(self) -> None:
        try:
            self.reason = self._attach()
        except Exception as exc:  # never let the fast path's failure reach the chat: the Python loop stays
            self.reason = f"{type(exc).__name__}: {exc}"
        if self.reason is not None:
            log.info("%s decodes through the compact forward's Python loop: %s", self.name, self.reason)

    def _attach(self) -> str | None:
        path = library_path()
        if not path.exists():
            log.info("building the native decoder layers for this machine in the background (%s)", path)
            failed = _build_in_background(path)
            if failed is not None:
                return failed
        load(path)
        differs = differs_from_python(self.forward, self.cache)
        if differs is not None:
            return f"the native layers' logits differ from the Python loop's ({differs}), so they are not used"
        with self._lock:
            if self._closed:
                return None
            self.forward.native = Native(self.forward, self.cache)
        log.info("%s decodes through the native layers (%s)", self.name, path.name)
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            native, self.forward.native = self.forward.native, None
        if native is not None:
            native.release()


def _pass(forward, seq, ids: torch.Tensor, native: Native | None) -> torch.Tensor:
    n = ids.numel()
    seq.reserve(n)
    plan = seq.plan(n)
    positions = torch.arange(plan.start, plan.kv_len)
    return forward.run(ids, positions, attention.PagedContext(seq.cache, plan), n, native)


def differs_from_python(forward, cache) -> str | None:
    """None when passes of 4 tokens and of 1 through the native layers give exactly the Python loop's logits
    (after a 40-token prompt, on a scratch cache like ``cache``), else how they differ."""
    first = forward.layers[0]
    scratch = PagedKVCache(num_layers=len(cache.k_layers), num_kv_heads=first.kv_heads, head_dim=first.head_dim,
                           num_blocks=3, block_size=16, dtype=cache.dtype, device="cpu")
    probe = Native(forward, scratch)
    try:
        ids = torch.randint(0, forward.embed.num_embeddings, (44,), generator=torch.Generator().manual_seed(0))
        seq = scratch.new_sequence()
        _pass(forward, seq, ids[:40], None)
        seq.commit(40)
        for rows in (4, 1):
            python = _pass(forward, seq, ids[40:40 + rows], None)
            native = _pass(forward, seq, ids[40:40 + rows], probe)
            if not torch.equal(python, native):
                return f"a {rows}-token pass, by up to {float((python - native).abs().max()):.3g}"
        return None
    finally:
        probe.release()


def attach(forward, cache, name: str) -> Attachment | None:
    """Start attaching the native layers to ``forward`` (a compact forward over ``cache``), unless switched off
    or not bindable (logged); returns the attachment to wait on or close."""
    if switched_off(SWITCH):
        return None
    reason = bindable(forward)
    if reason is not None:
        log.info("%s decodes through the compact forward's Python loop: the native layers do not cover %s",
                 name, reason)
        return None
    return Attachment(forward, cache, name)


def main(argv: list[str]) -> int:
    """``python -m specchat.backend.kernels.native build [OUT]``: build the library now (default: its cache
    path); prints where, or why not."""
    if not argv or argv[0] != "build" or len(argv) > 2:
        print("usage: python -m specchat.backend.kernels.native build [OUT]", file=sys.stderr)
        return 2
    out = Path(argv[1]) if len(argv) == 2 else library_path()
    failed = build(out)
    if failed is not None:
        print(f"specchat: the native decoder layers were not built: {failed}", file=sys.stderr)
        return BUSY_EXIT if failed == BUSY else 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
