"""The cyclic garbage collector around a model load: what is long-lived after loading is frozen out of it, so a
full collection never stalls decoding (:func:`settle_heap`), and an earlier load's frozen heap is released
before the next (:func:`start_heap`); and glibc's heap set so that large blocks are mappings of their own
(:func:`map_large_blocks`)."""

from __future__ import annotations

import ctypes
import gc

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 1 << 20  # blocks of this many bytes and more get their own mapping


def map_large_blocks() -> None:
    """glibc (Linux): every block of :data:`MMAP_THRESHOLD` bytes or more (weights, the native pass's buffers, a
    verification's logits) its own mapping, given back whole when freed. glibc's default threshold starts at
    128 KiB and rises to the size of each larger block freed (up to 32 MiB), after which such blocks are carved
    from the heap's arenas, where the holes they leave between long-lived blocks stay resident: a long prefill
    of a 152k-vocabulary model peaked ~14 MiB higher (``benchmarks/RESULTS.md``, "Memory to llama.cpp's level").
    1 MiB, not 128 KiB: a decoding step's logits rows stay in the heap, with no system call per step. Elsewhere
    (another C library): nothing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


def start_heap() -> None:
    """Before a load. After an earlier load (which froze the heap, its engine among it): unfreeze, so that the
    old engine can be collected. At the first load: freeze what is there instead (the imports' objects, once
    the young garbage is collected), so that the collections while loading and :func:`settle_heap`'s walk only
    the objects loading makes, which shortens both (``benchmarks/RESULTS.md``, "Start time and memory"). Garbage
    already old at that moment (import-time cycles: small) is kept until the next load unfreezes it."""
    map_large_blocks()
    if gc.get_freeze_count():
        gc.unfreeze()
    else:
        gc.collect(1)
        gc.freeze()


def settle_heap() -> None:
    """Collect the loading's garbage, then freeze what is left out of the cyclic garbage collector.

    torch, transformers and a loaded model leave hundreds of thousands of long-lived Python objects; a full collection
    walks them all with the GIL held (a visible stall: ``benchmarks/RESULTS.md``, "Figures moved out of the code"),
    and one starts whenever enough new objects have survived (a chat UI makes them quickly), so it lands inside a
    reply as a stall of decoding. Frozen objects are still freed by reference counting; only cycles among them wait
    for the next load's unfreeze.
    """
    gc.collect()
    gc.freeze()
