"""Measured memory, to check the model against: process RSS/USS, Jetson NvMap, CUDA device use.

- RSS / USS (psutil): what the process holds in DRAM. USS excludes pages shared with other
  processes (libraries), so its delta around a load is the load's own cost.
- NvMapMemUsed (/proc/meminfo, Jetson only): memory the integrated GPU allocated in the shared
  DRAM. It is not in the process RSS, so on a Jetson a load's cost is ΔRSS + ΔNvMap.
- CUDA device memory in use (NVML, discrete GPUs and Jetson): device-wide, so a delta around a
  load is only meaningful while nothing else allocates. NVML needs no CUDA context (which
  would itself cost hundreds of MB), so sampling it is cheap and side-effect free.
Every source that is absent here reads as None; none of this raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import psutil

from memspec.telemetry import read_meminfo

_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {}


@dataclass(frozen=True)
class MemorySample:
    rss: int
    uss: int | None = None
    nvmap_used: int | None = None
    cuda_used: int | None = None

    def delta(self, before: MemorySample) -> dict[str, int | None]:
        """Bytes gained since `before`, per source (None where either side is unknown)."""

        def d(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a - b

        return {
            "rss": self.rss - before.rss,
            "uss": d(self.uss, before.uss),
            "nvmap_used": d(self.nvmap_used, before.nvmap_used),
            "cuda_used": d(self.cuda_used, before.cuda_used),
        }


def cuda_used_bytes(device: int = 0) -> int | None:
    """Bytes in use on a CUDA device (NVML), or None without an NVIDIA driver."""
    with _nvml_lock:
        if _nvml_state.get("failed"):
            return None
        try:
            import pynvml

            if "handle" not in _nvml_state:
                pynvml.nvmlInit()
                _nvml_state["handle"] = pynvml.nvmlDeviceGetHandleByIndex(device)
            return int(pynvml.nvmlDeviceGetMemoryInfo(_nvml_state["handle"]).used)
        except Exception:  # no driver, no device, no library: not a failure, just absent
            _nvml_state["failed"] = True
            return None


def nvmap_used_bytes() -> int | None:
    return read_meminfo().get("NvMapMemUsed")


def sample(uss: bool = True, gpu: bool = True) -> MemorySample:
    """Memory now. uss=True walks the page tables (ms to tens of ms): not for hot paths."""
    proc = psutil.Process()
    if uss:
        full = proc.memory_full_info()
        rss, u = full.rss, full.uss
    else:
        rss, u = proc.memory_info().rss, None
    return MemorySample(
        rss=rss,
        uss=u,
        nvmap_used=nvmap_used_bytes() if gpu else None,
        cuda_used=cuda_used_bytes() if gpu else None,
    )


def device_bytes(delta: dict[str, int | None]) -> int:
    """A load's cost from a delta: process memory plus what a GPU took outside of it."""
    own = delta["uss"] if delta.get("uss") is not None else delta["rss"]
    # On a Jetson CUDA allocates through NvMap: count one of the two, never both.
    gpu = delta.get("nvmap_used")
    if gpu is None:
        gpu = delta.get("cuda_used")
    return int(own or 0) + max(gpu or 0, 0)
