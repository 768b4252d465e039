"""systemd/memspec.service: the directives the daemon's contract relies on, and limits that
agree with the default budget. `systemd-analyze verify` runs when it is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from launcher import ROOT

from memspec.config import Settings
from memspec.units import parse_size

UNIT = ROOT / "systemd" / "memspec.service"


def directives(unit: Path = UNIT) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_contract_directives():
    d = directives()
    expect = {
        "Type": "notify",
        "NotifyAccess": "main",
        "Restart": "on-failure",
        "User": "memspec",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "StateDirectory": "memspec",
        "PrivateTmp": "yes",
    }
    for key, value in expect.items():
        assert d.get(key) == [value], key
    assert int(d["WatchdogSec"][0]) >= 10
    assert set(d["SupplementaryGroups"][0].split()) == {"video", "jtop"}
    exec_start = d["ExecStart"][0]
    assert " serve " in exec_start and exec_start.split()[0].endswith("/memspec")
    env = " ".join(d["Environment"])
    assert "MEMSPEC_STATE_DIR=/var/lib/memspec" in env


def test_memory_limits_match_the_default_budget():
    d = directives()
    budget = Settings.model_fields["budget"].default
    budget_bytes = parse_size(budget)
    high, hard = (parse_size(d[k][0] + "iB") for k in ("MemoryHigh", "MemoryMax"))
    assert budget_bytes < high < hard
    assert high == budget_bytes + 512 * 2**20  # what deploy/jetson/install.sh writes too
    assert hard == budget_bytes + 2**30


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path: Path):
    unit = tmp_path / "memspec.service"
    text = UNIT.read_text()
    exec_line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    unit.write_text(text.replace(exec_line, "ExecStart=/bin/true"))  # no venv on this box
    r = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr


RPC_UNIT = ROOT / "systemd" / "memspec-rpc-worker.service"
GPU_DEVICES = {"/dev/nvmap rw", "char-nvhost* rw", "char-nvgpu* rw", "char-nvidia* rw"}


def test_hardening_directives():
    """Issue 29: devices closed but the Jetson GPU's, the system read-only, no privileged or
    resource syscalls, bounded descriptors and tasks, no core files."""
    d = directives()
    assert d["DevicePolicy"] == ["closed"] and set(d["DeviceAllow"]) == GPU_DEVICES
    # The models dir is written (pull, create, background draft builds: issue 53); everything
    # else on the system but the state dir stays read-only, an adopted Ollama store included.
    assert d["ProtectSystem"] == ["strict"] and "ReadWritePaths" not in d
    assert "-/var/lib/memspec/models" not in d.get("ReadOnlyPaths", [])
    assert "~@privileged @resources" in d["SystemCallFilter"]
    assert int(d["LimitNOFILE"][0]) >= 1024 and int(d["TasksMax"][0]) >= 64
    assert d["LimitCORE"] == ["0"]


def test_rpc_worker_unit():
    d = directives(RPC_UNIT)
    exec_start = d["ExecStart"][0].split()
    assert exec_start[0].endswith("/memspec") and exec_start[1:4] == [
        "rpc-worker",
        "--host",
        "127.0.0.1",
    ]
    assert "--allow-remote" not in exec_start
    expect = {
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "DevicePolicy": "closed",
        "IPAddressDeny": "any",
        "IPAddressAllow": "localhost",
        "CapabilityBoundingSet": "",
        "LimitCORE": "0",
        "RestrictAddressFamilies": "AF_INET AF_INET6",
    }
    for key, value in expect.items():
        assert d.get(key) == [value], key
    assert set(d["DeviceAllow"]) == GPU_DEVICES
    assert "~@privileged @resources" in d["SystemCallFilter"]
    assert "MemoryMax" in d and "TasksMax" in d and "LimitNOFILE" in d


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_rpc_worker_unit_verifies(tmp_path: Path):
    unit = tmp_path / "memspec-rpc-worker.service"
    text = RPC_UNIT.read_text()
    exec_line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    unit.write_text(text.replace(exec_line, "ExecStart=/bin/true"))
    r = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
