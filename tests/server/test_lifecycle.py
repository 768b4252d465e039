"""Start-up, systemd notify and watchdog, restart with tuned settings, bind safety."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from launcher import MODEL, ROOT, NotifySocket, start

from memspec.server.serve import BindRefused, check_bind, load_settings

pytestmark = pytest.mark.timeout(300)


def test_health_503_while_loading_then_ready(own_server, notify_socket):
    assert own_server.health_503_seen or notify_socket.times("STATUS=loading models")
    ready = notify_socket.wait_for("READY=1", timeout=5)
    loading = notify_socket.times("STATUS=loading models")
    assert loading and loading[0] <= ready
    assert notify_socket.times(f"STATUS=serving {MODEL}")  # the id /v1/models serves
    assert httpx.get(own_server.url + "/health").json() | {"uptime_s": 0} == {
        "status": "ok",
        "model": MODEL,
        "uptime_s": 0,
    }


def test_watchdog_pings_while_healthy(own_server, notify_socket):
    ready = notify_socket.wait_for("READY=1", timeout=5)
    time.sleep(2.0)  # WATCHDOG_USEC=2 s: a ping every ~0.67 s
    pings = [t for t in notify_socket.times("WATCHDOG=1") if t >= ready]
    assert len(pings) >= 2


def test_insecure_bind_refused(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "memspec.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "MEMSPEC_STATE_DIR": str(tmp_path)},
    )
    assert r.returncode == 2
    assert "refusing to bind 0.0.0.0" in r.stderr and "--allow-insecure-bind" in r.stderr
    assert "Traceback" not in r.stderr


def test_bind_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMSPEC_STATE_DIR", str(tmp_path))
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(load_settings(None, {"host": host}))
    with pytest.raises(BindRefused):
        check_bind(load_settings(None, {"host": "0.0.0.0"}))
    check_bind(load_settings(None, {"host": "0.0.0.0", "allow_insecure_bind": True}))
    monkeypatch.setenv("MEMSPEC_API_KEY", "k")
    check_bind(load_settings(None, {"host": "0.0.0.0"}))


def test_settings_precedence(tmp_path, monkeypatch):
    """CLI > tuned state > env > TOML > defaults."""
    toml = tmp_path / "config.toml"
    toml.write_text('k_max = 3\npolicy = "from-toml"\nmax_queue = 5\nn_ctx = 512\n')
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("MEMSPEC_STATE_DIR", str(state))
    s = load_settings(toml, {})
    assert (s.k_max, s.policy, s.max_queue, s.n_ctx) == (3, "from-toml", 5, 512)
    monkeypatch.setenv("MEMSPEC_K_MAX", "4")
    monkeypatch.setenv("MEMSPEC_MAX_QUEUE", "7")
    s = load_settings(toml, {})
    assert (s.k_max, s.max_queue) == (4, 7)
    (state / "tuned.json").write_text(json.dumps({"k_max": 5, "budget": "1GiB"}))
    s = load_settings(toml, {})
    assert (s.k_max, s.budget_bytes, s.policy) == (5, 2**30, "from-toml")
    s = load_settings(toml, {"k_max": 6, "n_ctx": None})
    assert (s.k_max, s.n_ctx) == (6, 512)
    (state / "tuned.json").write_text("{torn")  # a corrupt file is set aside, not fatal
    assert load_settings(toml, {}).k_max == 4
    assert (state / "tuned.corrupt").exists()


@pytest.fixture(scope="module")
def tuned_state(own_server, admin_http, state_dir):
    """Tune the shared daemon; its state dir is what the restarted daemon starts from."""
    r = admin_http.post("/admin/tune", json={"k_max": 5})
    assert r.status_code == 200, r.text
    return state_dir


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, tuned_state):
    notify = NotifySocket(str(tmp_path_factory.mktemp("notify-c") / "n.sock"))
    srv = start(
        tmp_path_factory.mktemp("restarted"),
        "lookup",
        env={
            "MEMSPEC_STATE_DIR": str(tuned_state),
            "NOTIFY_SOCKET": notify.address,
            "WATCHDOG_USEC": "1500000",
            "MEMSPEC_SHUTDOWN_GRACE_S": "0",
        },
        faults=True,
    )
    try:
        srv.wait_ready()
        yield srv, notify
    finally:
        srv.proc.kill()  # the last test leaves its engine stuck on purpose
        srv.stop()
        notify.close()


def test_restart_keeps_tuned_settings(restarted):
    srv, _ = restarted
    st = httpx.get(srv.url + "/admin/status").json()
    assert st["k_max"] == 5


def test_tune_n_ctx_live(restarted):
    srv, _ = restarted
    r = httpx.post(srv.url + "/admin/tune", json={"n_ctx": 512}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["n_ctx"] == 512
    st = httpx.get(srv.url + "/admin/status").json()
    assert st["n_ctx"] == 512 and st["state"] == "ready"
    over = {"model": MODEL, "prompt": "word " * 600, "max_tokens": 2}
    r = httpx.post(srv.url + "/v1/completions", json=over, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(srv.url + "/v1/completions", json=ok, timeout=60).status_code == 200


def test_tune_kv_cache_types_live(restarted):
    """A quantized cache, live: the context is rebuilt with it (its bytes in status drop),
    the answer is still served; a quantized V with flash attention off is refused."""
    srv, _ = restarted
    before = httpx.get(srv.url + "/admin/status").json()["working_set"]["target"]["kv"]
    bad = httpx.post(
        srv.url + "/admin/tune", json={"kv_type_v": "q8_0", "flash_attn": "off"}, timeout=60
    )
    assert bad.status_code == 400 and "flash attention" in bad.json()["error"]["message"]
    r = httpx.post(
        srv.url + "/admin/tune", json={"kv_type_k": "q8_0", "kv_type_v": "q8_0"}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["kv_type_v"] == "q8_0"
    st = httpx.get(srv.url + "/admin/status").json()
    assert st["state"] == "ready" and st["working_set"]["target"]["kv"] < 0.6 * before
    assert st["kv_cache"]["type_v"] == "q8_0" and st["kv_cache"]["flash_attn"]
    ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(srv.url + "/v1/completions", json=ok, timeout=60).status_code == 200
    back = {"kv_type_k": "f16", "kv_type_v": "f16"}
    assert httpx.post(srv.url + "/admin/tune", json=back, timeout=120).status_code == 200


def test_tune_n_ctx_auto_live(restarted):
    """n_ctx auto, live: the context is the budget's (status says how much and beside what),
    and a budget tune sizes it again."""
    srv, _ = restarted

    def tune(changes: dict) -> dict:
        r = httpx.post(srv.url + "/admin/tune", json=changes, timeout=120)
        assert r.status_code == 200, r.text
        st = httpx.get(srv.url + "/admin/status").json()
        assert st["state"] == "ready"
        return st

    st = tune({"n_ctx": "auto", "budget": "900MiB"})
    ctx = st["working_set"]["context"]
    assert (
        ctx["auto"] and st["n_ctx"] == ctx["n_ctx"] >= 2048 and ctx["drafts"] == ["prompt-lookup"]
    )
    assert st["used_bytes"]["modelled"] <= st["budget_bytes"] == 900 << 20
    smaller = tune({"budget": "800MiB"})
    assert smaller["n_ctx"] < st["n_ctx"] and smaller["budget_bytes"] == 800 << 20
    assert smaller["used_bytes"]["modelled"] <= 800 << 20
    ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(srv.url + "/v1/completions", json=ok, timeout=60).status_code == 200


def test_stuck_engine_stops_watchdog_pings(restarted):
    srv, notify = restarted
    notify.wait_for("READY=1", timeout=5)
    time.sleep(1.0)
    assert notify.times("WATCHDOG=1"), "no pings while healthy"
    stuck = {"model": MODEL, "prompt": "FAULT:hang", "max_tokens": 2}

    def send_stuck() -> None:
        try:
            httpx.post(srv.url + "/v1/completions", json=stuck, timeout=30)
        except httpx.HTTPError:
            pass  # the daemon is killed under it at the end

    threading.Thread(target=send_stuck, daemon=True).start()
    time.sleep(1.5 + 1.0)  # heartbeat goes stale after WATCHDOG_USEC (1.5 s)
    cutoff = time.monotonic()
    time.sleep(2.0)
    late = [t for t in notify.times("WATCHDOG=1") if t > cutoff]
    assert late == [], f"{len(late)} pings from a stuck engine"
    assert httpx.get(srv.url + "/health").status_code == 200  # HTTP still answers
