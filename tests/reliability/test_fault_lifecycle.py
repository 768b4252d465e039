"""Faults around the daemon's life: SIGTERM with streams in flight; kill -9 in the middle of
writing the tuned settings (a writer loop, then the daemon itself); a restart keeps the tuned
settings; a stuck engine stops the watchdog pings and a stand-in for systemd kills and restarts
it; tuned settings that can no longer load do not keep the daemon from starting; the predictor
artifact missing or corrupt.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from launcher import MODEL, Daemon, NotifySocket, RawStream, sse_events, start
from reliability_harness import assert_openai_error, completion, status

from memspec.server.state import load_state, save_state

pytestmark = pytest.mark.timeout(300)

PROMPT = "Count: one, two, three, four, five,"


def slow_body(prompt: str, max_tokens: int = 400, stream: bool = True) -> dict:
    return {"model": MODEL, "prompt": "FAULT:slow " + prompt, "max_tokens": max_tokens} | {
        "temperature": 0,
        "stream": stream,
    }


def test_sigterm_with_streams_in_flight(tmp_path):
    """One stream running, three waiting: the running one is cut cleanly after the grace
    (finish_reason "cancelled", then [DONE]), the waiting ones get a 503 shutting_down, and
    the process exits 0 well within systemd's TimeoutStopSec."""
    srv = start(
        tmp_path,
        "lookup",
        settings={"max_queue": 4},
        env={"MEMSPEC_SHUTDOWN_GRACE_S": "1"},
        faults=True,
    )
    try:
        srv.wait_ready()
        running = RawStream(srv.url, "/v1/completions", slow_body("a"))
        running.read_until(b"data: ")
        waiting = [
            RawStream(srv.url, "/v1/completions", slow_body(x, stream=x != "c")) for x in "bcd"
        ]
        deadline = time.monotonic() + 20
        while status(srv.url)["queue"]["depth"] < 3:
            assert time.monotonic() < deadline, "requests never queued"
            time.sleep(0.05)
        t0 = time.monotonic()
        srv.signal(signal.SIGTERM)
        raw = running.read_until(b"data: [DONE]", timeout=60)
        answers = [w.read_until(b"}", timeout=60) for w in waiting]
        assert srv.proc.wait(60) == 0, srv.logs()
        assert time.monotonic() - t0 < 20
    finally:
        srv.stop()
    events = sse_events(raw.split(b"\r\n\r\n", 1)[1])
    assert events[-1] == "[DONE]"
    finals = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict)]
    assert finals[-1] == "cancelled" and all(f is None for f in finals[:-1])
    for a in answers:
        head, _, body = a.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), a[:300]
        err = json.loads(body)["error"]
        assert err["code"] == "shutting_down" and err["message"], err


KILLS = 60
STATE_A = {"k_max": 3, "policy": "auto", "budget": "1GiB", "n_ctx": 512}
STATE_B = {"k_max": 7, "policy": "auto", "budget": "1" * 4000 + "B", "n_ctx": 1024}  # a longer
# file: a write takes longer, so more kills land inside one


def writer(path: Path) -> int:
    """A child process writing the tuned settings with the daemon's own save_state, A and B
    in turn, until it is killed."""
    pid = os.fork()
    if pid == 0:
        try:
            i = 0
            while True:
                save_state(path, STATE_A if i % 2 else STATE_B)
                i += 1
        finally:
            os._exit(0)
    return pid


@pytest.mark.slow
def test_kill_9_during_config_writes_never_tears_the_file(tmp_path):
    """The writer killed with SIGKILL at random moments, 60 times: the file is always exactly
    the old or the new settings."""
    path = tmp_path / "tuned.json"
    seen = set()
    rng = random.Random(5)
    for _ in range(KILLS):
        pid = writer(path)
        time.sleep(rng.uniform(0.002, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if not path.exists():
            continue  # killed before its first replace
        values = json.loads(path.read_text())  # never torn: always parses
        assert values in (STATE_A, STATE_B), values
        assert values == load_state(path)
        seen.add(values["k_max"])
    assert seen == {3, 7}, "the kills never landed between both states"
    # Kills that landed inside a write leave their temp file (never read): proof the torn
    # window was hit, and the file above was whole all the same.
    torn_windows = len(list(tmp_path.glob(".tuned.json.*.tmp")))
    print(f"\n{KILLS} kills, {torn_windows} inside a write")
    assert torn_windows >= 1


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lifecycle")
    return {"tmp": tmp, "state": tmp / "state"}


def start_in(lifecycle, name: str, notify: NotifySocket | None = None) -> Daemon:
    env = {"MEMSPEC_STATE_DIR": str(lifecycle["state"]), "MEMSPEC_SHUTDOWN_GRACE_S": "0"}
    if notify is not None:
        env |= {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": "1500000"}
    d = lifecycle["tmp"] / name
    d.mkdir()
    srv = start(d, "lookup", env=env, faults=True)
    srv.wait_ready()
    return srv


def test_kill_9_mid_tune_then_restart_keeps_the_settings(lifecycle):
    # (default tier: the tests below start from the state dir and answer it leaves)
    srv = start_in(lifecycle, "a")
    lifecycle["ref"] = completion(srv.url, PROMPT, 12, draft="none")
    written: list[int] = []
    stop = threading.Event()

    def storm() -> None:
        i = 0
        while not stop.is_set():
            k = 3 + i % 4
            try:
                if httpx.post(srv.url + "/admin/tune", json={"k_max": k}, timeout=10).is_success:
                    written.append(k)
            except httpx.HTTPError:
                return  # killed under us
            i += 1

    th = threading.Thread(target=storm)
    th.start()
    time.sleep(3.0)
    srv.proc.kill()  # SIGKILL: no shutdown, no flush, mid-write or not
    srv.proc.wait(10)
    stop.set()
    th.join(15)
    srv.stop()
    assert len(written) >= 3, "the tune storm never got going"
    persisted = json.loads((lifecycle["state"] / "tuned.json").read_text())
    assert persisted["k_max"] in (3, 4, 5, 6)
    lifecycle["k_max"] = persisted["k_max"]

    srv = start_in(lifecycle, "b")
    try:
        assert status(srv.url)["k_max"] == lifecycle["k_max"]  # the restart kept it
        assert completion(srv.url, PROMPT, 12) == lifecycle["ref"]
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_stuck_engine_is_killed_by_the_watchdog_and_restarts(lifecycle, tmp_path):
    """systemd's part played by the test: WatchdogSec 1.5 s; no WATCHDOG=1 for that long
    means SIGABRT (systemd's default), then Restart=on-failure starts it again."""
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    try:
        srv = start_in(lifecycle, "c", notify)
        notify.wait_for("READY=1", timeout=10)
        notify.wait_for("WATCHDOG=1", timeout=10)  # pinging while healthy

        def send_stuck() -> None:
            body = {"model": MODEL, "prompt": "FAULT:hang", "max_tokens": 2}
            try:
                httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            except httpx.HTTPError:
                pass  # the daemon is killed under it

        threading.Thread(target=send_stuck, daemon=True).start()
        deadline = time.monotonic() + 30
        while True:  # the stand-in for systemd's watchdog
            if time.monotonic() - max(notify.times("WATCHDOG=1")) > 1.5:  # WatchdogSec
                break
            assert time.monotonic() < deadline, "watchdog pings never stopped"
            time.sleep(0.1)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200  # HTTP still up
        srv.signal(signal.SIGABRT)
        assert srv.proc.wait(30) != 0  # a failure: Restart=on-failure applies
        srv.stop()
    finally:
        notify.close()
    srv = start_in(lifecycle, "d")  # the restart
    try:
        assert status(srv.url)["k_max"] == lifecycle["k_max"]
        assert completion(srv.url, PROMPT, 12) == lifecycle["ref"]
    finally:
        assert srv.stop() == 0


@pytest.mark.models
def test_unknown_tuned_policy_falls_back_and_keeps_the_rest(lifecycle):
    """A tuned policy this build does not know (renamed, or from a newer version): the daemon
    runs the configured policy (the default, `memspec`), says so, drops only that key from the
    file and keeps the other tunes."""
    state: Path = lifecycle["state"]
    (state / "tuned.json").write_text(json.dumps({"k_max": 5, "policy": "no-such-policy"}))
    srv = start_in(lifecycle, "e0")
    try:
        st = status(srv.url)
        assert st["policy"] == "memspec" and st["k_max"] == 5
        assert any("no-such-policy" in w for w in st["warnings"]), st["warnings"]
        assert json.loads((state / "tuned.json").read_text()) == {"k_max": 5}
        assert completion(srv.url, PROMPT, 12) == lifecycle["ref"]
    finally:
        assert srv.stop() == 0


@pytest.mark.models
def test_tuned_settings_that_cannot_load_do_not_stop_the_start(lifecycle):
    """A tuned budget below what the target needs (say the model file was swapped for a
    bigger one since): the daemon starts on the configured values, says so in its status,
    and sets the tuned file aside instead of failing every restart."""
    state: Path = lifecycle["state"]
    (state / "tuned.json").write_text(json.dumps({"k_max": 5, "budget": "64MiB"}))
    srv = start_in(lifecycle, "e")
    try:
        st = status(srv.url)
        assert st["budget_bytes"] == 2 << 30 and st["k_max"] == 8
        assert any("not applied" in w and "budget" in w for w in st["warnings"]), st["warnings"]
        assert not (state / "tuned.json").exists()
        assert json.loads((state / "tuned.rejected.json").read_text())["budget"] == "64MiB"
        assert completion(srv.url, PROMPT, 12) == lifecycle["ref"]
        r = httpx.post(srv.url + "/admin/tune", json={"policy": "no-such-policy"}, timeout=30)
        assert_openai_error(r, 400, "invalid_value")
        assert not (state / "tuned.json").exists()  # a refused tune writes nothing
    finally:
        assert srv.stop() == 0


def test_predictor_artifact_missing_or_corrupt(tmp_path):
    """The predictor falls back to per-kind priors, learning online, and says why. (The daemon
    does not load a predictor artifact yet: its policies are the runtime's; when it does, it
    must use this same fallback and put `describe()` in /admin/status.)"""
    from memspec.predictor.model import load_or_fallback

    cases = {
        "missing": tmp_path / "absent.json",
        "not json": tmp_path / "garbage.json",
        "wrong format": tmp_path / "other.json",
        "truncated": tmp_path / "torn.json",
    }
    cases["not json"].write_bytes(os.urandom(256))
    cases["wrong format"].write_text(json.dumps({"format": "something-else", "version": 99}))
    cases["truncated"].write_text('{"format": "memspec-predictor", "version": 1, "keys": {')
    for name, path in cases.items():
        pred = load_or_fallback(path)
        d = pred.describe()
        assert d["loaded"] is False and d["error"] and d["fallback"], (name, d)
        assert str(path) in d["error"] or "not found" in d["error"], (name, d)
        assert 0.0 <= pred.alpha(pred.request([1, 2, 3]), "q4_0", 0) <= 1.0
