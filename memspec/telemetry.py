"""Memory facts for status, metrics and the budget check: what the process and the device use.

`snapshot()` is the one entry point (the server calls it from /admin/status and /metrics). It
is cheap enough to call per request: psutil always; on a Jetson (detected by
/etc/nv_tegra_release) also /proc/meminfo `NvMapMemUsed` (memory the GPU holds in the shared
DRAM, invisible in the process RSS) and jetson-stats (`jtop`) when installed *and* its service
answers; CUDA device memory only when this process already uses CUDA through torch.

Nothing here raises for a missing source: an absent file, library or service is reported as
absent (None plus a reason), because telemetry must never take the daemon down.

Shape of a snapshot (bytes everywhere; None = not available here)::

    {"time": 1700000000.0,
     "process": {"pid": 123, "rss_bytes": ..., "uss_bytes": ... | None},
     "system": {"total_bytes", "available_bytes", "used_bytes", "swap_total_bytes",
                "swap_used_bytes"},
     "nvmap_used_bytes": ... | None,
     "jetson": None | {"l4t": "36.4.0", "jetpack": "6.1" | None, "board": ..., "model": ...},
     "jtop": None | {"ram_total_bytes", "ram_used_bytes", "ram_shared_bytes",
                     "swap_total_bytes", "swap_used_bytes"},
     "jtop_status": "ok" | "not a Jetson" | "disabled" | "not installed" | "unavailable: ...",
     "cuda": None | {"device": 0, "free_bytes", "total_bytes", "used_bytes"}}
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

DEFAULT_TEGRA_RELEASE = Path("/etc/nv_tegra_release")
DEFAULT_MEMINFO = Path("/proc/meminfo")
DEFAULT_DEVICE_MODEL = Path("/proc/device-tree/model")
# USS needs a page walk; with smaps_rollup (Linux >= 4.14) the kernel sums it in one read,
# without it psutil parses every mapping in /proc/PID/smaps, which is slow for a process that
# mmaps multi-GB GGUF files. So USS is reported only when the rollup file exists.
DEFAULT_SMAPS_ROLLUP = Path("/proc/self/smaps_rollup")

# L4T (the BSP in /etc/nv_tegra_release) -> JetPack, for humans only; nothing branches on it.
# Exact L4T version first, then major.minor.
_JETPACK = {
    "32.7": "4.6.x",
    "35.1": "5.0.2",
    "35.2": "5.1",
    "35.3": "5.1.1",
    "35.4": "5.1.2",
    "35.5": "5.1.3",
    "35.6.0": "5.1.4",
    "35.6.1": "5.1.5",
    "36.2": "6.0 DP",
    "36.3": "6.0",
    "36.4.0": "6.1",
    "36.4.3": "6.2",
    "36.4.4": "6.2.1",
    "38.2": "7.0",
}

_RELEASE_RE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")


@dataclass(frozen=True)
class L4TRelease:
    """The first line of /etc/nv_tegra_release, e.g. `# R36 (release), REVISION: 4.0, ...`."""

    major: int
    revision: str
    board: str | None = None
    arch: str | None = None

    @property
    def version(self) -> str:
        """'36.4.0' (JetPack's way of writing it: R36 + REVISION 4.0)."""
        return f"{self.major}.{self.revision}"

    @property
    def jetpack(self) -> str | None:
        v = self.version
        parts = v.split(".")
        return _JETPACK.get(v) or _JETPACK.get(".".join(parts[:2]))


def parse_nv_tegra_release(text: str) -> L4TRelease | None:
    m = _RELEASE_RE.search(text)
    if m is None:
        return None
    fields: dict[str, str] = {}
    for part in text.splitlines()[0].split(","):
        key, sep, value = part.partition(":")
        if sep:
            fields[key.strip().upper()] = value.strip()
    return L4TRelease(
        major=int(m.group(1)),
        revision=m.group(2),
        board=fields.get("BOARD"),
        arch=fields.get("EABI"),
    )


def read_l4t_release(path: Path | str = DEFAULT_TEGRA_RELEASE) -> L4TRelease | None:
    """The L4T release, or None when this is not a Jetson (or the file is unreadable)."""
    try:
        return parse_nv_tegra_release(Path(path).read_text(errors="replace"))
    except OSError:
        return None


def read_meminfo(path: Path | str = DEFAULT_MEMINFO) -> dict[str, int]:
    """/proc/meminfo as {key: bytes} ('kB' values converted; unit-less counts kept as-is)."""
    out: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        value = int(parts[0])
        if len(parts) > 1 and parts[1].lower() == "kb":
            value *= 1024
        out[key.strip()] = value
    return out


def jetson_info(
    tegra_release: Path | str = DEFAULT_TEGRA_RELEASE,
    device_model: Path | str = DEFAULT_DEVICE_MODEL,
) -> dict[str, Any] | None:
    rel = read_l4t_release(tegra_release)
    if rel is None:
        return None
    try:
        # Device-tree strings are NUL-terminated.
        model = Path(device_model).read_text(errors="replace").strip("\x00\n ") or None
    except OSError:
        model = None
    return {
        "l4t": rel.version,
        "jetpack": rel.jetpack,
        "board": rel.board,
        "arch": rel.arch,
        "model": model,
    }


def process_memory(
    pid: int | None = None, smaps_rollup: Path | str = DEFAULT_SMAPS_ROLLUP
) -> dict[str, Any]:
    proc = psutil.Process(pid)
    out: dict[str, Any] = {"pid": proc.pid, "rss_bytes": None, "uss_bytes": None}
    try:
        out["rss_bytes"] = proc.memory_info().rss
        if Path(smaps_rollup).exists():
            out["uss_bytes"] = proc.memory_full_info().uss
    except (psutil.Error, OSError):
        pass  # another user's process, or it just exited: report what we have
    return out


def system_memory() -> dict[str, int]:
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    return {
        "total_bytes": vm.total,
        "available_bytes": vm.available,
        "used_bytes": vm.total - vm.available,
        "swap_total_bytes": sw.total,
        "swap_used_bytes": sw.used,
    }


def cuda_memory() -> dict[str, int] | None:
    """Device free/total via torch, only if torch is already imported and CUDA already in use.

    Never imports torch (seconds and hundreds of MB). Also skips a torch that has not
    initialised CUDA: mem_get_info would create a CUDA context, which on a Jetson costs a few
    hundred MB of the very memory we are trying to measure.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
    except Exception:  # any driver/runtime error means "no CUDA figures", not a failure
        return None
    return {
        "device": int(device),
        "free_bytes": int(free),
        "total_bytes": int(total),
        "used_bytes": int(total - free),
    }


JtopFactory = Callable[[], Any]


def _default_jtop_factory() -> Any:
    from jtop import jtop  # optional extra `jetson`; ImportError means not installed

    return jtop()


class JtopProbe:
    """One long-lived jtop connection, opened lazily, with a back-off after a failure.

    Connecting to jtop.service costs a round trip plus a wait for its first sample, so the
    connection is kept and reused. `jtop().start()` raises (JtopException, OSError, ...) when
    the service is not installed, not running or not ours to talk to: all of that means "no
    Jetson telemetry", remembered for `retry_s` so a metrics scrape does not pay a failed
    connect every time.
    """

    def __init__(self, factory: JtopFactory | None = None, retry_s: float = 60.0) -> None:
        self._factory = factory or _default_jtop_factory
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._conn: Any = None
        self._failed_at: float | None = None
        self._reason = "not tried"

    def read(self) -> tuple[dict[str, int] | None, str]:
        """(memory figures in bytes, "ok") or (None, why not)."""
        with self._lock:
            now = time.monotonic()
            if self._conn is None:
                if self._failed_at is not None and now - self._failed_at < self._retry_s:
                    return None, self._reason
                self._conn = self._connect(now)
                if self._conn is None:
                    return None, self._reason
            try:
                if not self._conn.ok(spin=True):  # spin: never block the caller
                    raise RuntimeError("jtop connection closed")
                ram = self._conn.memory["RAM"]
                swap = self._conn.memory.get("SWAP", {})
            except Exception as e:  # the service went away: drop it and back off
                self._drop(now, f"unavailable: {_one_line(e)}")
                return None, self._reason
        kib = 1024  # jtop reports kB
        return (
            {
                "ram_total_bytes": int(ram.get("tot", 0)) * kib,
                "ram_used_bytes": int(ram.get("used", 0)) * kib,
                "ram_shared_bytes": int(ram.get("shared", 0)) * kib,
                "swap_total_bytes": int(swap.get("tot", 0)) * kib,
                "swap_used_bytes": int(swap.get("used", 0)) * kib,
            },
            "ok",
        )

    def _connect(self, now: float) -> Any:
        try:
            conn = self._factory()
        except ImportError:
            self._failed_at, self._reason = now, "not installed"
            return None
        except Exception as e:
            self._failed_at, self._reason = now, f"unavailable: {_one_line(e)}"
            return None
        try:
            conn.start()
        except Exception as e:  # JtopException without the service: not an error for us
            self._failed_at, self._reason = now, f"unavailable: {_one_line(e)}"
            return None
        self._failed_at, self._reason = None, "ok"
        return conn

    def _drop(self, now: float, reason: str) -> None:
        conn, self._conn = self._conn, None
        self._failed_at, self._reason = now, reason
        try:
            conn.close()
        except Exception:
            pass

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._drop(time.monotonic(), "closed")


_JTOP = JtopProbe()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:200]


def snapshot(
    *,
    tegra_release: Path | str = DEFAULT_TEGRA_RELEASE,
    meminfo: Path | str = DEFAULT_MEMINFO,
    device_model: Path | str = DEFAULT_DEVICE_MODEL,
    smaps_rollup: Path | str = DEFAULT_SMAPS_ROLLUP,
    use_jtop: bool | Literal["auto"] = "auto",
    jtop_probe: JtopProbe | None = None,
    pid: int | None = None,
) -> dict[str, Any]:
    """Memory facts now (see the module docstring for the shape). Never raises for a missing
    source. `use_jtop="auto"` asks jtop only on a Jetson: elsewhere there is no service."""
    jetson = jetson_info(tegra_release, device_model)
    mem = read_meminfo(meminfo)
    if use_jtop is False:
        jt, jt_status = None, "disabled"
    elif use_jtop == "auto" and jetson is None:
        jt, jt_status = None, "not a Jetson"
    else:
        jt, jt_status = (jtop_probe or _JTOP).read()
    return {
        "time": time.time(),
        "process": process_memory(pid if pid is not None else os.getpid(), smaps_rollup),
        "system": system_memory(),
        "nvmap_used_bytes": mem.get("NvMapMemUsed"),
        "jetson": jetson,
        "jtop": jt,
        "jtop_status": jt_status,
        "cuda": cuda_memory(),
    }


def process_bytes(snap: dict[str, Any]) -> int | None:
    """The process's own memory: USS when known (excludes shared library pages), else RSS."""
    proc = snap.get("process") or {}
    return proc.get("uss_bytes") or proc.get("rss_bytes")
