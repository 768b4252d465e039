"""Fixtures for the daemon's end-to-end tests: one shared real `memspec serve` (API key, admin
key, sd_notify socket, watchdog) and the official `openai` client pointed at it. Tests that
need their own daemon (faults, queue limits, SIGTERM, watchdog) start it themselves.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_harness import (
    ADMIN_KEY,
    API_KEY,
    N_CTX,
    N_THREADS,
    NotifySocket,
    ServerProcess,
    require_testbed,
)


@pytest.fixture(scope="session")
def notify_socket(tmp_path_factory) -> NotifySocket:
    ns = NotifySocket(str(tmp_path_factory.mktemp("notify") / "notify.sock"))
    yield ns
    ns.close()


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="session")
def server(tmp_path_factory, notify_socket, state_dir) -> ServerProcess:
    """The shared daemon: API and admin keys, default drafts, watchdog every 2 s."""
    require_testbed()
    srv = ServerProcess(
        tmp_path_factory.mktemp("server"),
        env={
            "MEMSPEC_API_KEY": API_KEY,
            "MEMSPEC_ADMIN_KEY": ADMIN_KEY,
            "MEMSPEC_STATE_DIR": str(state_dir),
            "NOTIFY_SOCKET": notify_socket.address,
            "WATCHDOG_USEC": "2000000",
        },
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


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
