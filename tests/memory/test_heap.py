"""memspec.memory.heap: freed heap pages go back to the OS (glibc's malloc_trim)."""

from __future__ import annotations

import ctypes
import ctypes.util

import psutil
import pytest

from memspec.memory.heap import return_freed_memory

PAGE = 4096


def test_freed_heap_is_returned():
    name = ctypes.util.find_library("c")
    if name is None or not hasattr(ctypes.CDLL(name), "malloc_trim"):
        pytest.skip("no glibc malloc_trim on this platform")
    libc = ctypes.CDLL(name)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 80 MB in blocks below the mmap threshold (the heap), then one block above them kept, so
    # free() cannot give the top of the heap back by itself: what a closed model leaves.
    blocks = [libc.malloc(PAGE) for _ in range(20_000)]
    for b in blocks:
        ctypes.memset(b, 1, PAGE)
    top = libc.malloc(PAGE)
    for b in blocks:
        libc.free(b)
    proc = psutil.Process()
    held = proc.memory_info().rss
    assert return_freed_memory()
    returned = held - proc.memory_info().rss
    libc.free(top)
    print(f"returned {returned / 2**20:.1f} MiB of 78 MiB freed")
    assert returned > 40 * 2**20
