"""Fixtures for the daemon's end-to-end tests: one shared real `memspec serve` (API key, admin
key, sd_notify socket, watchdog), or the one at MEMSPEC_TEST_URL, and the official `openai`
client pointed at it. Tests that need a daemon of their own (faults, queue limits, SIGTERM,
watchdog) start it themselves (tests/launcher.py).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from launcher import (
    ADMIN_KEY,
    API_KEY,
    EXTERNAL_URL,
    N_CTX,
    N_THREADS,
    NotifySocket,
    require_testbed,
    running,
    start,
)


@pytest.fixture(scope="session")
def notify_socket(tmp_path_factory) -> NotifySocket | None:
    """The shared daemon's systemd stand-in (None with MEMSPEC_TEST_URL)."""
    if EXTERNAL_URL:
        yield None
        return
    ns = NotifySocket(str(tmp_path_factory.mktemp("notify") / "notify.sock"))
    yield ns
    ns.close()


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="session")
def server(tmp_path_factory, notify_socket, state_dir):
    """The shared daemon: API and admin keys, default drafts, watchdog every 2 s."""
    env = {"MEMSPEC_STATE_DIR": str(state_dir), "WATCHDOG_USEC": "2000000"}
    if notify_socket is not None:
        env["NOTIFY_SOCKET"] = notify_socket.address
    with running(tmp_path_factory.mktemp("server"), shared=True, keys=True, env=env) as daemon:
        yield daemon


@pytest.fixture(scope="session")
def own_server(server):
    """The shared daemon, for tests that look at its process (logs, notify socket, state)."""
    server.require_own()
    return server


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def http(server) -> httpx.Client:
    with httpx.Client(
        base_url=server.url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        yield c


@pytest.fixture(scope="session")
def admin_http(server) -> httpx.Client:
    with httpx.Client(
        base_url=server.url, timeout=300, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ) as c:
        yield c


@pytest.fixture(scope="session")
def reference_runtime():
    """The target alone, in this process: what greedy API output must equal."""
    from memspec.config import Settings
    from memspec.runtime import Runtime

    require_testbed()
    rt = Runtime(Settings.load(drafts=[], n_ctx=N_CTX, n_threads=N_THREADS), calibrate_costs=False)
    yield rt
    rt.close()


QWEN_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


@pytest.fixture(scope="session")
def qwen_server(tmp_path_factory):
    """A daemon on Qwen2.5-Coder-1.5B (FIM tokens, a chat template with tools), prompt lookup
    as its draft; skipped when `memspec testbed fetch --family qwen2.5-coder` has not run.
    Slow on a CPU (~60 ms a token): its tests ask for a handful of tokens."""
    from memspec.paths import models_dir

    path = models_dir() / QWEN_TARGET
    if not path.is_file():
        pytest.skip(f"{QWEN_TARGET} not fetched")
    # k_max 2 and one slot: start-up calibrates the verify cost per batch size (cached after),
    # each a forward pass of the 1.5B.
    settings = {
        "target": str(path),
        "drafts": ["prompt-lookup"],
        "n_ctx": 2048,
        "k_max": 2,
        "parallel": 1,
    }
    daemon = start(tmp_path_factory.mktemp("qwen"), settings=settings, keys=True)
    try:
        # Loading and calibrating the 1.5B takes minutes on 2 busy cores.
        daemon.wait_ready(timeout=600)
        yield daemon
    finally:
        daemon.stop()
