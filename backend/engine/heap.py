"""The cyclic garbage collector around a model load: what is long-lived after loading is frozen out of it, so a
full collection never stalls decoding (:func:`settle_heap`), and an earlier load's frozen heap is released
before the next (:func:`start_heap`)."""

from __future__ import annotations

import gc


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
