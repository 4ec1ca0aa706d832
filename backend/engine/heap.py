"""The process's memory around a model load: the cyclic garbage collector (what is long-lived after loading is
frozen out of it, so a full collection never stalls decoding: :func:`settle_heap`; an earlier load's frozen heap
is released before the next: :func:`start_heap`), the libraries' code pages that only the start needed
(:func:`release_code_pages`), and glibc's arenas (:func:`one_arena`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import linecache
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path

MADV_PAGEOUT = 21  # linux/mman.h, Linux 5.4+; older kernels answer EINVAL and nothing is released
# shared libraries only (libtorch_cpu.so, tokenizers.abi3.so, libc.so.6): never a model file a path maps in place
SHARED_LIBRARY = re.compile(r"\.so(\.[0-9.]+)?$")
M_ARENA_MAX = -8  # glibc's malloc.h


def start_heap() -> None:
    """Before a load. After an earlier load (which froze the heap, its engine among it): unfreeze, so that the
    old engine can be collected. At the first load: freeze what is there instead (the imports' objects, once
    the young garbage is collected), so that the collections while loading and :func:`settle_heap`'s walk only
    the objects loading makes, which shortens both (``benchmarks/RESULTS.md``, "Start time and memory"). Garbage
    already old at that moment (import-time cycles: small) is kept until the next load unfreezes it."""
    if gc.get_freeze_count():
        gc.unfreeze()
    else:
        gc.collect(1)
        gc.freeze()
        one_arena()
    release_code_pages()


def settle_heap() -> None:
    """Collect the loading's garbage, then freeze what is left out of the cyclic garbage collector; then hand back
    the code pages the load touched once (:func:`release_code_pages`).

    torch, transformers and a loaded model leave hundreds of thousands of long-lived Python objects; a full collection
    walks them all with the GIL held (a visible stall: ``benchmarks/RESULTS.md``, "Figures moved out of the code"),
    and one starts whenever enough new objects have survived (a chat UI makes them quickly), so it lands inside a
    reply as a stall of decoding. Frozen objects are still freed by reference counting; only cycles among them wait
    for the next load's unfreeze.
    """
    linecache.clearcache()  # ~1 MiB of source lines torch's import read for its own introspection; reread on demand
    gc.collect()
    gc.freeze()
    release_code_pages()


def release_code_pages(library: re.Pattern[str] = SHARED_LIBRARY) -> int:
    """Ask Linux to drop the resident pages of the read-only mappings of files whose path ``library`` finds (the
    shared libraries); return the bytes of the mappings asked for (0 where nothing was: not Linux, no such
    mapping, a kernel before 5.4).

    torch's static initialisers and a load's first calls touch ~70 MiB of libraries' code (50 of libtorch_cpu
    alone) that no reply runs again; the kernel keeps it resident, in the process's resident set, until memory
    runs short. What a reply does run (~20 MiB) comes back on its first touch (``benchmarks/RESULTS.md``, "The
    libraries' code pages"). Only mappings with no anonymous page are asked: for a written (copied-on-write)
    page, paging out means swap. Linux keeps a page another process maps too (a second specchat's torch)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    asked = 0
    for start, end in _clean_mappings(smaps, library):
        if madvise(start, end - start, MADV_PAGEOUT) != 0:
            return asked  # EINVAL: a kernel before 5.4; the rest would answer the same
        asked += end - start
    return asked


def _clean_mappings(smaps: str, library: re.Pattern[str]) -> list[tuple[int, int]]:
    """(start, end) of each read-only mapping of a file whose path ``library`` finds that holds no anonymous page,
    from the text of /proc/self/smaps."""
    found: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in smaps.splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and len(fields[1]) == 4:  # a mapping's header line
            path = fields[5] if len(fields) > 5 else ""
            start, end = (int(part, 16) for part in fields[0].split("-"))
            current = (start, end) if library.search(path) and "w" not in fields[1] else None
        elif current is not None and fields[:1] == ["Anonymous:"]:
            if fields[1] == "0":
                found.append(current)
            current = None
    return found


def one_arena() -> bool:
    """Have threads that start allocating from now on share glibc's main malloc arena (``M_ARENA_MAX`` 1); True
    where it was set (glibc only).

    Each thread that allocates otherwise gets an arena of its own (up to 8 per core), and each keeps the holes its
    frees leave: the pass thread's beside the main thread's held ~5 MiB more at a full context's peak. The lock
    they then share costs nothing measurable here: a pass allocates a few buffers, and Python's small objects
    come from its own pools (``benchmarks/RESULTS.md``, "The libraries' code pages"). The ``specchat`` command
    calls it first thing, before any thread starts: a thread that allocated earlier keeps an arena of its own, and
    when it ends glibc hands that arena to the next new thread (the pass thread) before any limit applies. The
    first load calls it too, for other programs that load an engine."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    libc = _libc()
    return libc is not None and libc.mallopt(M_ARENA_MAX, 1) == 1


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


def _madvise() -> Callable[[int, int, int], int] | None:
    libc = _libc()
    if libc is None:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
