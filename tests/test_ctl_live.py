"""`memspec-ctl` against the real daemon: `memspec serve` on the testbed target, on a free
loopback port, with an admin key. The contract details and error paths that a live daemon
cannot be made to show on demand (a 429 burst, a 500 mid-bench) are in test_ctl.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from memspec.paths import models_dir


def require_testbed() -> None:
    # Not imported from conftest: several conftest modules exist and "conftest" is ambiguous.
    if not (models_dir() / "smollm2-135m-f32.gguf").is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)


KEY = "live-admin-key"
pytestmark = pytest.mark.timeout(240)

STATUS_KEYS = {
    "version",
    "uptime_s",
    "model",
    "backend",
    "policy",
    "k_max",
    "n_ctx",
    "budget_bytes",
    "used_bytes",
    "memory",
    "queue",
    "tokens_per_s_recent",
    "requests_served",
    "drafts",
}
DRAFT_KEYS = {"id", "kind", "bytes", "resident", "pinned", "acceptance", "requests"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    if importlib.util.find_spec("memspec.server") is None:
        pytest.skip("memspec.server is not in this checkout yet")
    require_testbed()
    tmp = tmp_path_factory.mktemp("daemon")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    if "MEMSPEC_DATA_DIR" in os.environ:
        env["MEMSPEC_DATA_DIR"] = os.environ["MEMSPEC_DATA_DIR"]
    env["MEMSPEC_ADMIN_KEY"] = KEY
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed in teardown
    # prompt-lookup only: no draft weights to load at start (the test loads q4_0 itself).
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "memspec.cli", "serve", "--port", str(port), "--n-ctx", "512",
            "--drafts", "prompt-lookup", "--n-threads", "1", "--state-dir", str(tmp / "state"),
            "--log-level", "warning",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"memspec serve exited {proc.returncode}:\n{_tail(tmp)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"memspec serve not ready after 180 s:\n{_tail(tmp)}")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _tail(tmp: Path) -> str:
    return "\n".join((tmp / "serve.log").read_text().splitlines()[-30:])


def ctl(url: str, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    cmd = [sys.executable, "-m", "memspec.ctl", "--url", url, "--timeout", "60"]
    if key:
        cmd += ["--key", key]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=120)


def one_line(p: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def status(url: str) -> dict:
    p = ctl(url, "status", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_status(daemon):
    st = status(daemon)
    assert STATUS_KEYS <= set(st)
    assert set(st["used_bytes"]) >= {"measured", "modelled"}
    assert st["used_bytes"]["measured"] > 0 and st["budget_bytes"] > 0
    assert st["memory"]["process"]["rss_bytes"] > 0  # telemetry.snapshot() made it through
    ids = {d["id"] for d in st["drafts"]}
    assert {"prompt-lookup", "q4_0"} <= ids
    assert all(DRAFT_KEYS <= set(d) for d in st["drafts"])
    p = ctl(daemon, "status")
    assert p.returncode == 0 and "DRAFT" in p.stdout and "prompt-lookup" in p.stdout
    assert "measured" in p.stdout and "modelled" in p.stdout


def test_drafts_load_evict_pin(daemon):
    p = ctl(daemon, "drafts", "load", "q4_0")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("loaded q4_0") and "resident yes" in p.stdout
    q4 = next(d for d in status(daemon)["drafts"] if d["id"] == "q4_0")
    assert q4["resident"] is True and q4["bytes"] > 0
    assert ctl(daemon, "drafts", "pin", "prompt-lookup").returncode == 0
    rows = json.loads(ctl(daemon, "drafts", "list", "--json").stdout)["drafts"]
    assert next(d for d in rows if d["id"] == "prompt-lookup")["pinned"] is True
    assert ctl(daemon, "drafts", "unpin", "prompt-lookup").returncode == 0
    p = ctl(daemon, "drafts", "evict", "q4_0", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["draft"]["resident"] is False


def test_errors(daemon):
    one_line(ctl(daemon, "drafts", "load", "no-such-draft"), 1, "no-such-draft", "404")
    one_line(ctl(daemon, "status", key="wrong"), 4, "401")
    one_line(ctl(daemon, "status", key=None), 4, "401")
    one_line(ctl(daemon, "tune", "budget", "lots"), 2, "not a size")


def test_tune(daemon):
    assert ctl(daemon, "tune", "k-max", "4").returncode == 0
    p = ctl(daemon, "tune", "budget", "1.5GiB", "--json")
    assert p.returncode == 0, p.stderr
    st = status(daemon)
    assert st["k_max"] == 4 and st["budget_bytes"] == int(1.5 * 1024**3)


def test_watch_and_bench(daemon):
    p = ctl(daemon, "watch", "--interval", "0.2", "--count", "2")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("DRAFT") == 2
    p = ctl(daemon, "bench", "--requests", "2", "--concurrency", "1", "--max-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["ok"] == 2 and rep["errors"] == 0 and rep["tokens"] > 0
    assert 0 < rep["ttft_s"]["p50"] <= rep["latency_s"]["p50"]
    assert status(daemon)["requests_served"] >= 2
