"""Load and soak against a real daemon over loopback, through the documented commands:

    memspec bench load --clients 32 --seconds 120    (32 streaming clients held for 2 minutes)
    memspec bench soak --minutes 1                   (the 30-minute soak, shortened)

Zero lost or corrupted responses (every greedy answer equal to the same request run alone),
queue-full answers are 429s, no 5xx, no hangs, process memory within the budget (the daemon's
/admin/status used_bytes.measured and psutil, sampled by the command and here too), and no
memory growth during the soak beyond its stated bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import psutil
import pytest
from launcher import ADMIN_KEY, API_KEY, ROOT, start

CLIENTS = 32
SECONDS = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The default daemon (drafts prompt-lookup and q4_0, max_queue 16, budget 2 GiB)."""
    srv = start(tmp_path_factory.mktemp("load"), keys=True)
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.logs()


class PeakRSS:
    """psutil on the daemon's pid from the test process, every 0.5 s."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def bench(daemon, *args: str, out, timeout: float) -> tuple[dict, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "memspec.cli", "bench", *args, "--url", daemon.url]
    cmd += ["--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"no report (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(out.read_text()), p


def test_32_streaming_clients_for_2_minutes(daemon, tmp_path):
    rss = PeakRSS(daemon.proc.pid)
    t0 = time.monotonic()
    rep, p = bench(
        daemon,
        "load",
        "--clients",
        str(CLIENTS),
        "--seconds",
        str(SECONDS),
        out=tmp_path / "load.json",
        timeout=SECONDS + 300,
    )
    peak = rss.stop()
    print(f"\n{p.stderr.strip()}")
    print(json.dumps({k: rep[k] for k in ("ok", "rejected_429", "tokens_per_s", "latency_s")}))
    failed = [k for k, ok in rep["checks"].items() if not ok]
    assert p.returncode == 0 and not failed, f"{failed}: {json.dumps(rep['failures'][:5])}"
    assert rep["clients"] == CLIENTS and rep["wall_s"] >= SECONDS
    assert time.monotonic() - t0 < SECONDS + 240  # it stops by itself
    # Nothing lost, nothing corrupted, the queue overflowed into 429s (not 5xx, not hangs).
    assert rep["lost"] == rep["corrupted"] == rep["server_errors_5xx"] == rep["hung"] == 0
    assert rep["client_errors_4xx"] == 0
    assert rep["rejected_429"] > 0, "32 clients never filled the queue of 16"
    assert rep["greedy_checked"] >= 32 and rep["ok"] >= 32
    assert set(rep["ok_per_draft"]) == {"auto", "none", "prompt-lookup", "q4_0"}
    for key in ("p50", "p90", "p99"):
        assert rep["latency_s"][key] is not None and rep["ttft_s"][key] is not None
    assert rep["tokens_per_s"] > 0
    # Memory within the budget: what the daemon reports and what psutil sees from outside.
    mem = rep["memory"]
    assert mem["within_budget"] is True and mem["samples"] >= SECONDS // 4
    assert mem["peak_measured_bytes"] <= mem["budget_bytes"]
    assert 0 < peak <= mem["budget_bytes"], f"RSS peak {peak >> 20} MiB"


def test_soak_memory_flat(daemon, tmp_path):
    rep, p = bench(daemon, "soak", "--minutes", "1", out=tmp_path / "soak.json", timeout=300)
    print(f"\n{p.stderr.strip()}")
    growth = rep["growth"]
    print(
        json.dumps(
            {
                k: growth[k]
                for k in (
                    "rss_growth_bytes",
                    "prefix_cache_growth_bytes",
                    "unexplained_growth_bytes",
                )
            }
        )
    )
    failed = [k for k, ok in rep["checks"].items() if not ok]
    assert p.returncode == 0 and not failed, f"{failed}: {json.dumps(rep['failures'][:5])}"
    # Memory at start and end is reported, and the growth is within the stated bound.
    assert growth["start"]["rss"] and growth["end"]["rss"]
    assert growth["unexplained_growth_bytes"] <= growth["max_growth_bytes"] == 64 << 20
    assert growth["end"]["prefix_cache"] <= growth["end"]["prefix_cache_capacity"]
    # The mix ran: sessions, completions, hang-ups, malformed requests, scrapes.
    assert set(rep["actions"]) >= {"session", "completion", "disconnect", "bad"}
    assert rep["repeats_checked"] > 0 and rep["corrupted"] == rep["lost"] == 0
    assert all(400 <= s < 500 for s in rep["malformed_answers"])
