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


def directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
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
