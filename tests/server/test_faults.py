"""Faults injected on purpose into a real daemon: engine errors, a full queue, a client that
hangs up, SIGTERM mid-stream. No keys here (loopback, admin open); max_queue 1.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from launcher import MODEL, Daemon, NotifySocket, RawStream, sse_events, start

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def notify(tmp_path_factory):
    ns = NotifySocket(f"@memspec-test-{os.getpid()}-faults")  # abstract namespace
    yield ns
    ns.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, notify):
    srv = start(
        tmp_path_factory.mktemp("faults"),
        "lookup",
        settings={"max_queue": 1},
        env={
            "MEMSPEC_SHUTDOWN_GRACE_S": "1",
            "NOTIFY_SOCKET": notify.address,
            "FAULT_LOAD_DELAY_S": "3",
        },
        faults=True,
    )
    try:
        srv.while_loading = while_loading(srv, notify)
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def while_loading(srv: Daemon, notify: NotifySocket) -> dict:
    """What the daemon answers in its first seconds, while the models load (3 s slower)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.logs()
        try:
            health = httpx.get(srv.url + "/health", timeout=2)
        except httpx.HTTPError:
            time.sleep(0.1)
            continue
        v1 = httpx.post(srv.url + "/v1/completions", json=body("hi"), timeout=5)
        return {"health": health, "v1": v1, "ready_sent": "READY=1" in notify.lines()}
    raise AssertionError(f"daemon never answered:\n{srv.logs()}")


@pytest.fixture(scope="module")
def oai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def body(prompt: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def wait_idle(daemon, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = httpx.get(daemon.url + "/admin/status").json()
        if not st["queue"]["busy"] and st["queue"]["depth"] == 0:
            return st
        time.sleep(0.1)
    raise AssertionError(f"engine still busy after {timeout}s: {st['queue']}")


def test_http_answers_503_while_loading_then_ready(daemon, notify):
    seen = daemon.while_loading
    assert seen["health"].status_code == 503, seen["health"].text
    assert seen["health"].json()["status"] == "loading"
    assert seen["health"].json()["error"]["code"] == "not_ready"
    assert seen["v1"].status_code == 503 and "retry-after" in seen["v1"].headers
    assert seen["v1"].json()["error"]["code"] == "model_loading"
    assert not seen["ready_sent"]  # READY only once the models are loaded
    notify.wait_for("READY=1", timeout=10)  # on the abstract-namespace socket
    assert httpx.get(daemon.url + "/health").status_code == 200


def test_engine_error_is_a_clean_500_and_the_next_request_works(daemon, oai):
    r = httpx.post(daemon.url + "/v1/completions", json=body("FAULT:raise now"), timeout=120)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_error"
    assert "Traceback" not in err["message"] and "injected" not in err["message"]
    ok = oai.completions.create(model=MODEL, prompt="Hello,", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_engine_error_mid_stream(daemon, oai):
    stream = oai.completions.create(
        model=MODEL,
        prompt="FAULT:midstream Count: one, two,",
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    ok = oai.completions.create(model=MODEL, prompt="Hello,", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_full_queue_answers_429_with_retry_after(daemon):
    running = RawStream(daemon.url, "/v1/completions", body("FAULT:slow a", 200, stream=True))
    waiting = None
    try:
        running.read_until(b"data: ")  # it holds the engine now
        waiting = RawStream(daemon.url, "/v1/completions", body("FAULT:slow b", 200, True))
        deadline = time.monotonic() + 10
        while httpx.get(daemon.url + "/admin/status").json()["queue"]["depth"] < 1:
            assert time.monotonic() < deadline, "second request never queued"
            time.sleep(0.05)
        r = httpx.post(daemon.url + "/v1/completions", json=body("third"), timeout=30)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        running.close()
        if waiting is not None:
            waiting.close()
    wait_idle(daemon)  # both hung up: the running one is cut, the waiting one skipped


def test_disconnect_frees_the_slot(daemon, oai):
    before = httpx.get(daemon.url + "/admin/status").json()["requests_served"]
    s = RawStream(daemon.url, "/v1/completions", body("FAULT:slow story", 300, stream=True))
    s.read_until(b"data: ")
    t0 = time.monotonic()
    s.close()
    st = wait_idle(daemon, timeout=15)
    assert time.monotonic() - t0 < 10  # cut within a round or two, not after 300 tokens
    assert st["requests_served"] == before + 1
    ok = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_sigterm_during_stream_exits_0(daemon, notify):
    s = RawStream(daemon.url, "/v1/completions", body("FAULT:slow long", 400, stream=True))
    s.read_until(b"data: ")
    t0 = time.monotonic()
    daemon.signal(signal.SIGTERM)
    late: list[int] = []

    def try_new_request() -> None:  # while shutting down: refused or not listening
        time.sleep(0.3)
        try:
            late.append(httpx.post(daemon.url + "/v1/completions", json=body("x")).status_code)
        except httpx.HTTPError:
            late.append(0)

    th = threading.Thread(target=try_new_request)
    th.start()
    raw = s.read_until(b"data: [DONE]", timeout=60)
    s.close()
    th.join(30)
    assert daemon.proc.wait(60) == 0, daemon.logs()
    assert time.monotonic() - t0 < 30
    events = sse_events(raw.split(b"\r\n\r\n", 1)[1])
    assert events[-1] == "[DONE]"
    finals = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict)]
    assert finals[-1] == "cancelled"  # cut cleanly after the grace period
    assert late and late[0] in (0, 503)
    notify.wait_for("STOPPING=1", timeout=5)
    assert notify.times("STOPPING=1")[0] >= notify.times("READY=1")[0]
