"""engine/heap.py's glibc setting: after map_large_blocks, a block of MMAP_THRESHOLD bytes or more is a mapping of its
own (given back whole when freed), even after larger blocks were freed (which raise glibc's default threshold)."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from specchat.backend.engine import heap


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _mapped_bytes() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblkhd)


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0].startswith("glibc"), reason="glibc")
def test_large_blocks_are_mappings_of_their_own():
    freed = torch.empty(16 * 2**20, dtype=torch.uint8)
    del freed  # glibc's default would now carve blocks up to 16 MiB from the heap
    heap.map_large_blocks()
    before = _mapped_bytes()
    block = torch.empty(4 * heap.MMAP_THRESHOLD, dtype=torch.uint8)
    assert _mapped_bytes() - before >= block.numel()
    del block
    assert _mapped_bytes() - before < heap.MMAP_THRESHOLD
