"""`memspec-ctl` against the real daemon: `memspec serve` on the testbed target with both keys
(tests/launcher.py; or the one at MEMSPEC_TEST_URL). The contract details and error paths
that a live daemon cannot be made to show on demand (a 429 burst, a 500 mid-bench) are in
test_ctl.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launcher import ADMIN_KEY, API_KEY, running

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


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # prompt-lookup only: no draft weights to load at start (the test loads q4_0 itself).
    tmp = tmp_path_factory.mktemp("daemon")
    settings = {"n_ctx": 512, "log_level": "warning"}
    with running(tmp, "lookup", shared=True, keys=True, settings=settings) as d:
        yield d.url


def ctl(url: str, *args: str, key: str | None = ADMIN_KEY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    cmd = [sys.executable, "-m", "memspec.ctl", "--url", url, "--timeout", "60"]
    cmd += ["--api-key", API_KEY]  # bench's /v1 requests
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
