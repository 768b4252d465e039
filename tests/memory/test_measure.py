"""Measured-memory hooks: process RSS/USS always; NvMap and CUDA only where they exist."""

from __future__ import annotations

import mmap
from pathlib import Path

from memspec.memory.measure import device_bytes, nvmap_used_bytes, sample


def test_sample_sees_a_real_allocation():
    # In the full suite other threads (a working set's loader) may allocate or free at the same
    # moment, so take the best of three tries; one clean reading shows the sampler works.
    deltas = []
    for _ in range(3):
        before = sample()
        # An anonymous mapping with every page written: fresh pages, whatever the allocator's
        # free lists hold (a numpy array can reuse already-resident heap and show no growth).
        block = mmap.mmap(-1, 64 * 1024 * 1024)
        for off in range(0, len(block), 4096):
            block[off] = 1
        d = sample().delta(before)
        block.close()
        deltas.append(d)
        if 60e6 < d["rss"] < 90e6 and 60e6 < d["uss"] < 90e6:
            return
    raise AssertionError(f"no reading saw the 64 MiB allocation: {deltas}")


def test_gpu_sources_are_absent_or_numbers():
    s = sample()
    jetson = Path("/etc/nv_tegra_release").exists()
    assert (s.nvmap_used is not None) == (jetson and nvmap_used_bytes() is not None)
    assert s.cuda_used is None or s.cuda_used >= 0


def test_device_bytes_counts_gpu_memory_once():
    base = {"rss": 100, "uss": 90}
    assert device_bytes({**base, "nvmap_used": None, "cuda_used": None}) == 90
    assert device_bytes({**base, "nvmap_used": 50, "cuda_used": 50}) == 140  # Jetson: NvMap
    assert device_bytes({**base, "nvmap_used": None, "cuda_used": 70}) == 160  # discrete GPU
    assert device_bytes({"rss": 100, "uss": None, "nvmap_used": None, "cuda_used": None}) == 100
