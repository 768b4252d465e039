"""memspec.telemetry: fixture files for the Jetson sources, real psutil for the process.

jtop is exercised for real where it can be on this x86 box: the installed jetson-stats library
(if present) with no jtop.service must mean "no Jetson telemetry", never an error. Its success
path and a CUDA-initialised torch cannot exist here; those use small labelled stand-ins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import psutil
import pytest

from memspec import telemetry
from memspec.telemetry import JtopProbe, parse_nv_tegra_release, snapshot

pytestmark = pytest.mark.timeout(60)

ORIN_RELEASE = (
    "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, "
    "DATE: Fri Sep 13 04:36:44 UTC 2024\n"
    "# KERNEL_VARIANT: oot\n"
    "TARGET_USERSPACE_LIB_DIR=nvidia\n"
    "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)
MEMINFO = """\
MemTotal:        7802236 kB
MemFree:          312456 kB
MemAvailable:    3212340 kB
Buffers:           41288 kB
Cached:          2871620 kB
SwapTotal:       3901104 kB
SwapFree:        3901104 kB
HugePages_Total:       0
NvMapMemUsed:    1245184 kB
"""


@pytest.fixture()
def jetson_files(tmp_path: Path) -> dict[str, Path]:
    rel = tmp_path / "nv_tegra_release"
    rel.write_text(ORIN_RELEASE)
    mem = tmp_path / "meminfo"
    mem.write_text(MEMINFO)
    model = tmp_path / "model"
    model.write_bytes(b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00")
    return {"tegra_release": rel, "meminfo": mem, "device_model": model}


@pytest.mark.parametrize(
    "line, version, jetpack",
    [
        (ORIN_RELEASE, "36.4.0", "6.1"),
        ("# R36 (release), REVISION: 4.3, BOARD: generic", "36.4.3", "6.2"),
        ("# R35 (release), REVISION: 5.0, BOARD: t186ref", "35.5.0", "5.1.3"),
        ("# R32 (release), REVISION: 7.4, BOARD: t210ref", "32.7.4", "4.6.x"),
        ("# R99 (release), REVISION: 1.0, BOARD: future", "99.1.0", None),
    ],
)  # fmt: skip
def test_parse_release(line: str, version: str, jetpack: str | None):
    rel = parse_nv_tegra_release(line)
    assert rel is not None
    assert rel.version == version and rel.jetpack == jetpack


def test_parse_release_fields():
    rel = parse_nv_tegra_release(ORIN_RELEASE)
    assert (rel.major, rel.revision, rel.board, rel.arch) == (36, "4.0", "generic", "aarch64")
    assert parse_nv_tegra_release("not a release file\n") is None
    assert parse_nv_tegra_release("") is None


def test_meminfo(jetson_files):
    mem = telemetry.read_meminfo(jetson_files["meminfo"])
    assert mem["NvMapMemUsed"] == 1245184 * 1024
    assert mem["MemAvailable"] == 3212340 * 1024
    assert mem["HugePages_Total"] == 0  # unit-less count kept as is
    assert telemetry.read_meminfo(jetson_files["meminfo"].parent / "absent") == {}


def test_real_meminfo():
    mem = telemetry.read_meminfo()
    assert mem["MemTotal"] == psutil.virtual_memory().total
    if not Path("/etc/nv_tegra_release").exists():
        assert "NvMapMemUsed" not in mem


# jetson-stats' own start-up thread calls a deprecated `distro` function; not ours to fix.
@pytest.mark.filterwarnings("ignore:distro.linux_distribution:DeprecationWarning")
def test_snapshot_on_a_jetson_without_jtop_service(jetson_files):
    """The real jetson-stats library (if installed) with no service answering."""
    probe = JtopProbe()
    t0 = time.monotonic()
    snap = snapshot(**jetson_files, jtop_probe=probe)
    assert time.monotonic() - t0 < 10
    assert snap["jetson"] == {
        "l4t": "36.4.0",
        "jetpack": "6.1",
        "board": "generic",
        "arch": "aarch64",
        "model": "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
    }
    assert snap["nvmap_used_bytes"] == 1245184 * 1024
    assert snap["jtop"] is None
    try:
        import jtop  # noqa: F401
    except ImportError:
        assert snap["jtop_status"] == "not installed"
    else:
        assert snap["jtop_status"].startswith("unavailable"), snap["jtop_status"]
    # Backed off: a second snapshot does not try to connect again.
    calls = []
    probe._factory = lambda: calls.append(1)  # would fail loudly if called
    again = snapshot(**jetson_files, jtop_probe=probe)
    assert calls == [] and again["jtop_status"] == snap["jtop_status"]


def test_snapshot_not_a_jetson(tmp_path):
    def never():
        raise AssertionError("jtop must not be tried off a Jetson")

    snap = snapshot(
        tegra_release=tmp_path / "absent",
        meminfo=tmp_path / "absent",
        jtop_probe=JtopProbe(factory=never),
    )
    assert snap["jetson"] is None and snap["nvmap_used_bytes"] is None
    assert snap["jtop"] is None and snap["jtop_status"] == "not a Jetson"
    assert snapshot(tegra_release=tmp_path / "absent", use_jtop=False)["jtop_status"] == "disabled"


def test_real_process_and_system_memory():
    ballast = bytearray(64 * 1024 * 1024)  # touched pages: RSS must see them
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    snap = snapshot(tegra_release="/nonexistent")
    proc = snap["process"]
    assert proc["pid"] == os.getpid()
    assert proc["rss_bytes"] >= 64 * 1024 * 1024
    assert abs(proc["rss_bytes"] - psutil.Process().memory_info().rss) < 32 * 1024 * 1024
    if Path("/proc/self/smaps_rollup").exists():
        assert 0 < proc["uss_bytes"] <= proc["rss_bytes"]
        assert telemetry.process_bytes(snap) == proc["uss_bytes"]
    sysm = snap["system"]
    assert 0 < sysm["available_bytes"] <= sysm["total_bytes"]
    assert sysm["used_bytes"] == sysm["total_bytes"] - sysm["available_bytes"]
    del ballast


def test_uss_skipped_without_smaps_rollup(tmp_path):
    snap = snapshot(tegra_release=tmp_path / "absent", smaps_rollup=tmp_path / "absent")
    assert snap["process"]["uss_bytes"] is None
    assert telemetry.process_bytes(snap) == snap["process"]["rss_bytes"] > 0


class _FakeJtop:
    """Stand-in for a jtop connection to a running service (none can run on this box)."""

    def __init__(self) -> None:
        self.started = 0
        self.alive = True
        self.memory = {
            "RAM": {"tot": 7802236, "used": 4000000, "shared": 1245184},
            "SWAP": {"tot": 3901104, "used": 1024},
        }

    def start(self) -> None:
        self.started += 1

    def ok(self, spin: bool = False) -> bool:
        assert spin, "must not block the caller"
        return self.alive

    def close(self) -> None:
        pass


def test_jtop_probe_reads_and_reuses_connection(jetson_files):
    made: list[_FakeJtop] = []

    def factory():
        made.append(_FakeJtop())
        return made[-1]

    probe = JtopProbe(factory=factory, retry_s=0.0)
    snap = snapshot(**jetson_files, jtop_probe=probe)
    assert snap["jtop_status"] == "ok"
    assert snap["jtop"] == {
        "ram_total_bytes": 7802236 * 1024,
        "ram_used_bytes": 4000000 * 1024,
        "ram_shared_bytes": 1245184 * 1024,
        "swap_total_bytes": 3901104 * 1024,
        "swap_used_bytes": 1024 * 1024,
    }
    snapshot(**jetson_files, jtop_probe=probe)
    assert len(made) == 1 and made[0].started == 1  # one connection, reused
    made[0].alive = False  # the service went away
    snap = snapshot(**jetson_files, jtop_probe=probe)
    assert snap["jtop"] is None and snap["jtop_status"].startswith("unavailable")
    assert snapshot(**jetson_files, jtop_probe=probe)["jtop_status"] == "ok"  # reconnected
    assert len(made) == 2


def test_jtop_start_raising_is_not_an_error(jetson_files):
    class Refusing(_FakeJtop):
        def start(self) -> None:
            raise ConnectionRefusedError(111, "Connection refused")

    snap = snapshot(**jetson_files, jtop_probe=JtopProbe(factory=Refusing))
    assert snap["jtop"] is None and "Connection refused" in snap["jtop_status"]


def test_cuda_never_imports_torch():
    code = (
        "import sys, memspec.telemetry as t; "
        "print(t.cuda_memory(), 'torch' in sys.modules, t.snapshot()['cuda'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["None", "False", "None"]


def _fake_torch(initialized: bool) -> types.ModuleType:
    """Stand-in for torch with CUDA (no GPU here); records whether mem_get_info was called."""
    calls: list[int] = []
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: initialized,
        current_device=lambda: 0,
        mem_get_info=lambda d: calls.append(d) or (3 * 1024**3, 8 * 1024**3),
    )
    mod = types.ModuleType("torch")
    mod.cuda = cuda
    mod.calls = calls
    return mod


def test_cuda_only_when_already_initialised(monkeypatch):
    fake = _fake_torch(initialized=False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert telemetry.cuda_memory() is None and fake.calls == []  # no context created for us
    fake = _fake_torch(initialized=True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert telemetry.cuda_memory() == {
        "device": 0,
        "free_bytes": 3 * 1024**3,
        "total_bytes": 8 * 1024**3,
        "used_bytes": 5 * 1024**3,
    }
