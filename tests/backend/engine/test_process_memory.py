"""engine/heap.py's process memory: release_code_pages (which mappings it asks Linux to drop, that a dropped page
leaves the resident set and reads back, that torch still runs after) and one_arena (threads share one arena)."""

from __future__ import annotations

import mmap
import platform
import re
import subprocess
import sys
import textwrap

import pytest

from specchat.backend.engine.heap import SHARED_LIBRARY, _clean_mappings, release_code_pages

SMAPS = """\
7f0000000000-7f0000200000 r--p 00000000 08:01 11 /site/torch/lib/libtorch_cpu.so
Size:               2048 kB
Rss:                 512 kB
Anonymous:             0 kB
VmFlags: rd mr mw me
7f0000200000-7f0001000000 r-xp 00200000 08:01 11 /site/torch/lib/libtorch_cpu.so
Size:              14336 kB
Anonymous:             0 kB
7f0001000000-7f0001100000 r--p 01000000 08:01 11 /site/torch/lib/libtorch_cpu.so
Size:               1024 kB
Anonymous:           256 kB
7f0001100000-7f0001200000 rw-p 01100000 08:01 11 /site/torch/lib/libtorch_cpu.so
Size:               1024 kB
Anonymous:             0 kB
7f0001200000-7f0001300000 r-xp 00000000 08:01 12 /usr/lib/libc.so.6
Size:               1024 kB
Anonymous:             0 kB
7f0001300000-7f0001400000 rw-p 00000000 00:00 0
Size:               1024 kB
Anonymous:          1024 kB
7f0001400000-7f0001500000 r--p 00000000 08:01 13 /models/model.so.gguf
Size:               1024 kB
Anonymous:          1024 kB
"""


def test_only_read_only_mappings_of_the_prefix_with_no_anonymous_page_are_asked() -> None:
    found = _clean_mappings(SMAPS, SHARED_LIBRARY)
    # the relocated (anonymous) read-only part, the writable data, the model file and the heap are left alone
    assert found == [
        (0x7F0000000000, 0x7F0000200000),
        (0x7F0000200000, 0x7F0001000000),
        (0x7F0001200000, 0x7F0001300000),
    ]
    assert _clean_mappings(SMAPS, re.compile("libc[.]so")) == [(0x7F0001200000, 0x7F0001300000)]


def _mapping_rss_kib(path: str) -> int:
    rss, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and len(fields[1]) == 4:
            inside = len(fields) > 5 and fields[5] == path
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1])
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT and /proc are Linux's")
def test_a_read_only_files_touched_pages_leave_the_resident_set(tmp_path) -> None:
    """The mechanism on a file only this process maps (torch's own pages are shared with pytest's process, which
    imported torch too, and Linux keeps a page another process maps)."""
    library = tmp_path / "lib" / "libcode.so.1"
    library.parent.mkdir()
    library.write_bytes(bytes(range(256)) * (8 * 4096))  # 8 MiB
    with open(library, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert (
            sum(mapped[offset + 1] for offset in range(0, len(mapped), 4096)) == len(mapped) // 4096
        )  # every page touched
        before = _mapping_rss_kib(str(library))
        asked = release_code_pages(re.compile(re.escape(str(library))))
        after = _mapping_rss_kib(str(library))
        if asked == 0:
            pytest.skip("this kernel has no MADV_PAGEOUT (before Linux 5.4)")
        assert asked == len(mapped)
        assert before >= 8 * 1024 - 64 and after < 1024
        assert mapped[4096 * 100 + 7] == 7  # a dropped page reads back from the file


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT and /proc are Linux's")
def test_torch_runs_the_same_after_its_code_pages_are_released() -> None:
    probe = textwrap.dedent(
        """
        import torch
        from specchat.backend.engine.heap import release_code_pages
        torch.manual_seed(0)
        x = torch.randn(64, 64)
        first = (x @ x).softmax(-1).sum(0)
        asked = release_code_pages()
        print(asked > 0, torch.equal(first, (x @ x).softmax(-1).sum(0)))
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True"]


ARENAS = textwrap.dedent(
    """
    import ctypes, ctypes.util, os, sys, tempfile, threading
    from specchat.backend.engine.heap import one_arena
    if sys.argv[1] == "one":
        assert one_arena()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    def allocate():
        for _ in range(64):
            libc.malloc(4096)  # small blocks: from the thread's arena, not a mapping of their own
    threads = [threading.Thread(target=allocate) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = tempfile.mktemp()
    handle = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, handle)
    libc.fclose(handle)
    print(open(path).read().count("<heap nr="))
    os.unlink(path)
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="M_ARENA_MAX is glibc's")
def test_one_arena_makes_new_threads_share_the_main_arena() -> None:
    def arenas(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True)
        return int(done.stdout)

    assert arenas("one") == 1
    assert arenas("many") > 1  # what glibc does by itself: the test sees the difference
