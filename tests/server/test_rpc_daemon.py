"""The daemon with its target split over two ggml RPC workers (loopback behind latency relays,
tests/rpc_workers.py), driven by the official `openai` client: a worker unreachable at start
keeps /health at 503 with the reason until it answers; a worker killed mid-stream ends that
request with a clean error, the daemon stays up and serves again once the worker is back."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from launcher import MODEL, Daemon, start
from rpc_workers import workers

# Slow tier: a kill-and-restart test (a worker killed mid-stream, then back); the split target
# itself is checked in the default tier by tests/rpc/.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(d: Daemon, max_tokens: int = 16) -> str:
    r = _client(d).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].text


def _health(d: Daemon) -> tuple[int, str]:
    """/health's status and body; (0, "") before the daemon listens."""
    try:
        r = httpx.get(d.url + "/health", timeout=5)
    except httpx.HTTPError:
        return 0, ""
    return r.status_code, r.text


def _wait(cond, what: str, d: Daemon, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert d.proc.poll() is None, f"daemon exited:\n{d.logs()}"
        assert time.monotonic() < deadline, f"{what} not within {timeout}s:\n{d.logs()}"
        time.sleep(0.3)


def test_split_target_serves_survives_a_lost_worker_and_waits_for_one_at_start(tmp_path):
    # Reference: the same request on a daemon with the whole target here.
    (tmp_path / "local").mkdir()
    local = start(tmp_path / "local", "lookup")
    try:
        local.wait_ready()
        want = _complete(local)
    finally:
        local.stop()

    with workers(tmp_path, 2, delay_s=0.001) as ws:
        ws[1].kill()  # one worker is down when the daemon starts
        d = start(tmp_path, "lookup", settings={"rpc": [w.endpoint for w in ws]})
        try:
            _wait(lambda: _health(d)[0] == 503 and "unreachable" in _health(d)[1],
                  "503 naming the unreachable worker", d)  # fmt: skip
            status = httpx.get(d.url + "/admin/status", timeout=5).json()
            assert status["state"] == "waiting_for_device"
            assert [x["device"] for x in status["devices"]] == ["local", *(w.endpoint for w in ws)]
            r = httpx.post(d.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "device_unavailable"

            ws[1].start()
            _wait(lambda: _health(d)[0] == 200, "ready once the worker is back", d)
            assert _complete(d) == want
            status = httpx.get(d.url + "/admin/status", timeout=5).json()
            devices = status["devices"]
            assert sum(x["layers"] for x in devices) > 0 and all("bytes" in x for x in devices)
            # The target's process counts: its local third of the F32 weights (~170 MB).
            assert status["used_bytes"]["measured"] > 150_000_000

            # A worker killed mid-stream: that stream ends with an error, nothing else breaks.
            stream = _client(d).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True
            )
            got = 0
            with pytest.raises(openai.APIError):
                for _ in stream:
                    got += 1
                    if got == 3:
                        ws[0].kill()
            assert d.proc.poll() is None
            _wait(lambda: _health(d)[0] == 503, "503 while the worker is lost", d)
            assert "rpc worker" in _health(d)[1]
            with pytest.raises(openai.APIStatusError) as err:
                _complete(d)
            assert err.value.status_code == 503

            ws[0].start()
            _wait(lambda: _health(d)[0] == 200, "ready once the worker is back", d)
            assert _complete(d) == want
        finally:
            code = d.stop()
        assert code == 0, d.logs()  # a clean SIGTERM shutdown after all that
