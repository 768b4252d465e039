"""`memspec bench daemon`: the split of a request's wall time, the threads' CPU time by name,
and one short real run against the daemon (slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launcher import ROOT, require_testbed

from memspec.compat import name_os_thread
from memspec_lab.bench.daemon import _split, _summarize, _thread_cpu


def test_a_named_thread_shows_its_cpu_time_under_its_name():
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs Linux /proc")
    done = threading.Event()

    def spin() -> None:
        name_os_thread("bench-spin")
        end = time.process_time() + 10
        while not done.is_set() and time.process_time() < end:
            pass

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    cpu: dict[str, float] = {}
    while time.monotonic() < deadline:
        cpu = _thread_cpu(os.getpid())
        if cpu.get("bench-spin", 0.0) >= 0.05:
            break
        time.sleep(0.05)
    done.set()
    t.join()
    assert cpu.get("bench-spin", 0.0) >= 0.05, cpu


def test_the_split_adds_up_to_the_wall_time():
    stats = {"elapsed_ms": 900.0, "phases_ms": {"prefill": 300.0, "verify_decode": 500.0,
                                                "draft_steps": 50.0}}
    split = _split(1.0, stats)
    assert split["outside"] == pytest.approx(0.1)
    assert split["loop"] == pytest.approx(0.05)
    assert sum(split.values()) == pytest.approx(1.0)
    row = {"kind": "code", "wall_s": 1.0, "tokens": 10, "split_s": split,
           "memspec": {"proposed": 4, "accepted": 3}}
    s = _summarize({"requests": [row]})
    assert s["tokens_per_s"] == 10.0
    assert s["ceiling_tokens_per_s"] == pytest.approx(10 / 0.95, rel=1e-3)  # drafting free
    assert (s["proposed"], s["accepted"]) == (4, 3)


@pytest.mark.slow
@pytest.mark.models
def test_bench_daemon_cli(tmp_path):
    require_testbed()
    out = tmp_path / "daemon.json"
    cmd = [sys.executable, "-m", "memspec.cli", "bench", "daemon", "--target",
           "smollm2-135m-f32.gguf", "--threads", "1", "--prompts", "1", "--passes", "1",
           "--max-tokens", "4", "--no-peer", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)
    rep = json.loads(out.read_text())
    runs = rep["summary"]["1"]
    assert set(runs) == {"memspec plain", "memspec auto"}
    for s in runs.values():
        assert s["tokens"] > 0 and s["tokens_per_s"] > 0
        assert s["cpu_s_by_thread"].get("memspec-engine", 0) > 0  # decoding was measured
        assert s["split_s"]["prefill"] > 0
