"""The memory this process may use at most: the cgroup's limit (systemd's MemoryMax) and the
machine's RAM (/proc/meminfo MemTotal). A budget above either can never be honoured: the
kernel's OOM killer ends the daemon first, at every start, once such a budget is persisted."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# What the process needs beside the budget (interpreter, libraries, HTTP): the unit's
# MemoryMax is the budget + 1 GiB, so this leaves room.
RUNTIME_HEADROOM = 256 << 20


def meminfo_total(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_memory_max(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
) -> int | None:
    """The tightest memory.max on this process's cgroup v2 path (None: no limit, or v1)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rel = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    if rel is None:
        return None
    tightest: int | None = None
    d = root / rel.lstrip("/")
    while True:
        try:
            raw = (d / "memory.max").read_text().strip()
            if raw != "max":
                tightest = min(int(raw), tightest or int(raw))
        except (OSError, ValueError):
            pass
        if d == root or root not in d.parents:
            break
        d = d.parent
    return tightest


def budget_ceiling() -> tuple[int, str] | None:
    """The largest budget that can run here and what sets it, or None if nothing is known."""
    limits: list[tuple[int, str]] = []
    total = meminfo_total()
    if total is not None:
        limits.append((total, "this machine's memory (/proc/meminfo MemTotal)"))
    cg = cgroup_memory_max()
    if cg is not None:
        limits.append(
            (
                max(0, cg - RUNTIME_HEADROOM),
                "the service's MemoryMax (cgroup) less the runtime's headroom",
            )
        )
    return min(limits) if limits else None
