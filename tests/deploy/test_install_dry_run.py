"""deploy/jetson/install.sh --dry-run: prints detection and every planned step, changes nothing.

The script runs for real (bash, real detection code) with its detection inputs pointed at
fixture files, and with every command that could change the system (useradd, apt-get,
systemctl, install, ...) shadowed on PATH by a stub that records the call and fails. A dry
run must leave that record empty and create no file.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from memspec.config import Settings

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "jetson" / "install.sh"
PROFILE = REPO / "deploy" / "jetson" / "orin-nano-8gb.toml"
MUTATORS = [
    "apt-get", "useradd", "usermod", "groupadd", "systemctl", "install", "cp", "mv", "rm",
    "mkdir", "chown", "chmod", "ln", "pip", "pip3", "mktemp", "tee",
]  # fmt: skip
UNIT = """\
[Unit]
Description=MemSpec
[Service]
Type=notify
User=memspec
SupplementaryGroups=video jtop
ExecStart=/opt/memspec/venv/bin/memspec serve --config /etc/memspec/config.toml
"""
pytestmark = pytest.mark.timeout(60)


def llama_pin() -> str:
    m = re.search(r'"llama-cpp-python==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert m
    return m.group(1)


def tree_digest(*roots: Path) -> str:
    h = hashlib.sha256()
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    log = tmp_path / "calls.log"
    for name in MUTATORS:
        f = stubs / name
        f.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 97\n')
        f.chmod(f.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    rel = tmp_path / "nv_tegra_release"
    rel.write_text(
        "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
        "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\n"
    )
    model = tmp_path / "model"
    model.write_bytes(b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00")
    swaps = tmp_path / "swaps"
    swaps.write_text(
        "Filename\tType\tSize\tUsed\tPriority\n"
        "/dev/zram0 partition 634768 0 5\n/dev/zram1 partition 634768 0 5\n"
    )
    unit = tmp_path / "memspec.service"
    unit.write_text(UNIT)
    return {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "MEMSPEC_TEGRA_RELEASE": str(rel),
        "MEMSPEC_DEVICE_MODEL": str(model),
        "MEMSPEC_SWAPS": str(swaps),
        "MEMSPEC_UNIT_SRC": str(unit),
        "CALLS_LOG": str(log),
    }


def install(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def assert_nothing_changed(env: dict[str, str], prefix: Path) -> None:
    log = Path(env["CALLS_LOG"])
    assert not log.exists(), f"system-changing commands ran: {log.read_text()}"
    assert not prefix.exists()


def test_dry_run_on_an_orin(env, tmp_path):
    prefix = tmp_path / "opt" / "memspec"
    before = tree_digest(REPO / "deploy", REPO / "drafts")
    etc_before = (
        Path("/etc/memspec").exists(),
        Path("/etc/systemd/system/memspec.service").exists(),
    )
    p = install(env, "--dry-run", "--prefix", str(prefix))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    # Detection
    assert "Jetson, L4T 36.4.3 (JetPack 6.2), NVIDIA Jetson Orin Nano" in out
    assert "swap: zram 1.2 GiB" in out
    assert "problem" not in out or "not a Jetson" not in out
    # The plan, in order
    steps = [
        "apt-get install -y",
        "useradd --system --user-group --home-dir /var/lib/memspec",
        "usermod -aG video memspec",
        f"{prefix}/venv",  # the venv (created or kept)
        "CMAKE_ARGS=-DGGML_CUDA=on\\ -DCMAKE_CUDA_ARCHITECTURES=87\\ -DGGML_RPC=ON",
        f"--no-binary llama-cpp-python llama-cpp-python=={llama_pin()}",
        f"{prefix}/venv/bin/pip install {REPO}\\[jetson\\]",
        "/etc/memspec/config.toml",
        "/etc/memspec/drafts/q4_0.toml",
        "write /etc/systemd/system/memspec.service (mode 0644)",
        "write /etc/systemd/system/memspec-rpc-worker.service (mode 0644)",
        "write /etc/systemd/system/memspec.service.d/10-memory.conf",
        "systemctl daemon-reload",
        "systemctl enable memspec.service",
        "Dry run: nothing was changed",
    ]
    pos = 0
    for step in steps:
        if "useradd" in step and "memspec exists" in out:
            continue  # a box where the user already exists
        at = out.find(step, pos)
        assert at >= 0, (step, out)
        pos = at
    # The unit is rewritten for the prefix, and the jtop group dropped when it does not exist.
    assert f"|   ExecStart={prefix}/venv/bin/memspec serve" in out
    assert f"|   ExecStart={prefix}/venv/bin/memspec rpc-worker --host 127.0.0.1" in out
    assert "systemctl enable memspec-rpc-worker" not in out  # installed, not enabled
    jtop_group = subprocess.run(["getent", "group", "jtop"], capture_output=True).returncode == 0
    if not jtop_group:
        assert "|   SupplementaryGroups=video\n" in out
        assert "usermod -aG jtop" not in out
    # Memory limits follow the profile's 4.5 GiB budget (4608 MiB).
    assert "MemoryHigh=5120M" in out and "MemoryMax=5632M" in out
    assert_nothing_changed(env, prefix)
    assert tree_digest(REPO / "deploy", REPO / "drafts") == before
    etc_after = (
        Path("/etc/memspec").exists(),
        Path("/etc/systemd/system/memspec.service").exists(),
    )
    assert etc_after == etc_before


def test_dry_run_no_enable_and_not_a_jetson(env, tmp_path):
    prefix = tmp_path / "p"
    env = {**env, "MEMSPEC_TEGRA_RELEASE": str(tmp_path / "absent")}
    p = install(env, "--dry-run", "--no-enable", f"--prefix={prefix}")
    assert p.returncode == 0, p.stderr
    assert "not a Jetson" in p.stdout and "a real run would stop here" in p.stdout
    assert "systemctl enable" not in p.stdout and "--no-enable" in p.stdout
    assert "systemctl daemon-reload" in p.stdout
    assert_nothing_changed(env, prefix)


def test_real_run_refuses_a_non_jetson_before_acting(env, tmp_path):
    prefix = tmp_path / "p"
    env = {**env, "MEMSPEC_TEGRA_RELEASE": str(tmp_path / "absent")}
    p = install(env, "--prefix", str(prefix))
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("install.sh: error: not a Jetson"), p.stderr
    assert "==>" in p.stdout and "1. Build tools" not in p.stdout
    assert_nothing_changed(env, prefix)


def test_bad_options(env):
    p = install(env, "--bogus")
    assert p.returncode == 2 and "unknown option: --bogus" in p.stderr
    p = install(env, "--dry-run", "--prefix", "relative/dir")
    assert p.returncode == 2 and "absolute" in p.stderr
    p = install(env, "--help")
    assert p.returncode == 0 and "--dry-run" in p.stdout


def test_old_jetpack_is_reported(env, tmp_path):
    rel = tmp_path / "old"
    rel.write_text(
        "# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t210ref, EABI: aarch64\n"
    )
    p = install(
        {**env, "MEMSPEC_TEGRA_RELEASE": str(rel)}, "--dry-run", "--prefix", "/nonexistent/x"
    )
    assert p.returncode == 0
    assert "L4T 32.7.4 (JetPack 4.6.x)" in p.stdout
    assert "too old: Orin needs JetPack 5" in p.stdout


def old_python(tmp_path: Path, version: str = "3.9") -> str:
    """A `python3` that says it is `version` (the real interpreter, sys.version_info replaced)."""
    major, minor = version.split(".")
    f = tmp_path / f"python{version}"
    f.write_text(
        '#!/bin/sh\n[ "$1" = -c ] && shift\n'
        f"exec {sys.executable} -c 'import sys; code = sys.argv.pop(1); "
        f'sys.version_info = ({major}, {minor}, 18, "final", 0); exec(code)\' "$@"\n'
    )
    f.chmod(0o755)
    return str(f)


def test_an_old_python_stops_a_real_run_first_even_forced(env, tmp_path):
    prefix = tmp_path / "p"
    python = old_python(tmp_path)
    for args in ([], ["--force"]):
        p = install({**env, "PYTHON": python}, "--prefix", str(prefix), *args)
        assert p.returncode == 1, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1, p.stderr
        assert lines[0].startswith(f"install.sh: error: {python} is Python 3.9; MemSpec needs")
        assert "Python >= 3.10" in lines[0] and "PYTHON=python3.10" in lines[0]
        assert "1. Build tools" not in p.stdout
        assert_nothing_changed(env, prefix)
    p = install({**env, "PYTHON": str(tmp_path / "absent")}, "--prefix", str(prefix), "--force")
    assert p.returncode == 1 and "absent not found: MemSpec needs Python >= 3.10" in p.stderr
    # A dry run reports it and goes on.
    p = install({**env, "PYTHON": python}, "--dry-run", "--prefix", str(prefix))
    assert p.returncode == 0, p.stderr
    assert f"python       {python} 3.9 (MemSpec needs >= 3.10)" in p.stdout
    assert "is Python 3.9; MemSpec needs Python >= 3.10" in p.stdout
    assert "a real run stops here, even with --force" in p.stdout
    assert_nothing_changed(env, prefix)


def test_the_budget_step_needs_only_the_standard_library():
    """install.sh reads the budget with the system Python (no venv, so none of MemSpec's
    dependencies): memspec.units may import the standard library alone."""
    code = (
        "import sys; from memspec.units import parse_size; print(parse_size('4.5GiB'));"
        "print(sorted({m.split('.')[0] for m in sys.modules}"
        " - set(sys.stdlib_module_names) - {'__main__', 'memspec'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == [str(int(4.5 * 1024**3)), "[]"]


def test_profile_matches_settings(monkeypatch):
    for key in list(os.environ):
        if key.startswith("MEMSPEC_"):
            monkeypatch.delenv(key)
    s = Settings.load(PROFILE)  # extra="forbid": a key that is not a Settings field fails here
    assert s.budget_bytes == int(4.5 * 1024**3)
    assert s.n_gpu_layers == -1 and s.host == "127.0.0.1" and s.backend == "llama_cpp"
    assert s.k_max > 0 and s.n_ctx == "auto"
    # The Jetson-sized pair, its whole family as the pool (no allow-list, no manifest dir that
    # would replace the family's).
    assert s.target == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert s.drafts is None and s.manifest_dir is None
    # Every number carries a comment saying why (on the lines just above it).
    lines = PROFILE.read_text().splitlines()
    for key in ("n_gpu_layers", "n_threads", "n_ctx", "k_max", "budget"):
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{key} = "))
        assert lines[i - 1].startswith("#"), f"no comment above {key}"


def test_profile_context_auto_holds_a_whole_file_beside_the_sibling(monkeypatch):
    """The profile's n_ctx auto on the Jetson pair, as the footprint model plans it: the 0.5B
    sibling (and prompt lookup) kept, and a code assistant's 4-16k-token files fit a slot."""
    from memspec.memory.footprint import Footprint, draft_footprint
    from memspec.memory.plan import DraftFit, plan_context
    from memspec.paths import models_dir

    for key in list(os.environ):
        if key.startswith("MEMSPEC_"):
            monkeypatch.delenv(key)
    s = Settings.load(PROFILE)  # its data_dir is the Jetson's: the models are found here
    target = models_dir() / s.target
    sibling = models_dir() / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not (target.is_file() and sibling.is_file()):
        pytest.skip("the Qwen2.5-Coder pair is not fetched")

    def drafts_at(n: int) -> list[DraftFit]:
        fp = draft_footprint("model", sibling, n, None, s.n_gpu_layers, s.draft_kv_cache)
        return [
            DraftFit("prompt-lookup", "prompt_lookup", Footprint(), 0.5),
            DraftFit("sibling", "model", fp, 0.5),
        ]

    plan = plan_context(
        s.budget_bytes, target, s.k_max, drafts_at, s.n_ctx, s.parallel, s.n_gpu_layers,
        s.kv_cache,
    )  # fmt: skip
    assert plan.drafts == ["prompt-lookup", "sibling"]
    assert plan.n_ctx >= 16384 and plan.n_ctx <= plan.trained
    assert plan.target_bytes + plan.drafts_bytes <= s.budget_bytes
