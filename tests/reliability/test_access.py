"""Access: the admin API refuses anything but the admin key, completions need the API key,
keys are compared in constant time and never logged (the shared daemon logs at debug level and
its whole log is searched), a non-loopback bind without a key is refused at start unless
overridden, and the systemd unit's exposure is what docs/security.md records.
"""

from __future__ import annotations

import hmac
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from launcher import ADMIN_KEY, API_KEY, MODEL, ROOT
from reliability_harness import assert_openai_error, status
from starlette.requests import Request

from memspec.server import auth
from memspec.server.serve import BindRefused, check_bind, load_settings

pytestmark = pytest.mark.timeout(300)

WRONG = "sk-wrong-LEAKCHECK-7f3e"  # must never show up in a log or an answer either
ADMIN_ROUTES = [
    ("GET", "/admin/status", None),
    ("GET", "/admin/drafts", None),
    ("POST", "/admin/drafts/prompt-lookup/evict", None),
    ("POST", "/admin/drafts/q4_0/pin", None),
    ("POST", "/admin/tune", {"k_max": 1}),
]
V1_ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ),
]


# Ollama's routes (docs/ollama.md) take the same key; `/` and /api/version are its clients' probes.
OLLAMA_ROUTES = [
    ("GET", "/api/tags", None),
    ("GET", "/api/ps", None),
    ("POST", "/api/show", {"model": MODEL}),
    (
        "POST",
        "/api/chat",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": False,
            "options": {"num_predict": 2},
        },
    ),
    (
        "POST",
        "/api/generate",
        {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
    ),
]


def refused_headers() -> list[dict[str, str | bytes]]:
    return [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {WRONG}"},
        {"Authorization": f"Basic {ADMIN_KEY}"},
        {"Authorization": ADMIN_KEY},
        {"Authorization": f"Bearer {ADMIN_KEY}x"},
        {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"},
        {"Authorization": b"Bearer \xff\xfe\xc3\x28"},  # not UTF-8
        {"Authorization": "Bearer " + "k" * 4000},
    ]


def call(url: str, method: str, path: str, body, headers) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def assert_refused(r: httpx.Response) -> None:
    assert_openai_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    for secret in (API_KEY, ADMIN_KEY, WRONG):
        assert secret not in r.text


def test_admin_refuses_without_the_admin_key(hardened):
    before = status(hardened.url, hardened.admin)
    api_key = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, body in ADMIN_ROUTES:
        for headers in [*refused_headers(), api_key]:
            assert_refused(call(hardened.url, method, path, body, headers))
    after = status(hardened.url, hardened.admin)
    assert after["k_max"] == before["k_max"]  # nothing refused was applied
    assert [d["resident"] for d in after["drafts"]] == [d["resident"] for d in before["drafts"]]
    lower = {"Authorization": f"bearer {ADMIN_KEY}"}  # the scheme is case-insensitive
    assert call(hardened.url, "GET", "/admin/status", None, lower).status_code == 200


def test_completions_require_the_api_key(hardened):
    admin_key = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for method, path, body in V1_ROUTES:
        for headers in [*refused_headers()[:8], admin_key]:
            assert_refused(call(hardened.url, method, path, body, headers))
        r = call(hardened.url, method, path, body, hardened.api)
        assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=hardened.url + "/v1", api_key=WRONG, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    ok = openai.OpenAI(base_url=hardened.url + "/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_health_and_metrics_are_open_and_hold_no_secret(hardened):
    for path in ("/health", "/metrics"):
        r = httpx.get(hardened.url + path, timeout=30)
        assert r.status_code == 200
        assert API_KEY not in r.text and ADMIN_KEY not in r.text


def test_oversize_authorization_header_is_refused(hardened):
    # uvicorn stops reading at its 16 KB header limit, answers 400 and closes. The client is
    # still writing, so the kernel may answer the unread bytes with a reset that beats the 400
    # to the client: either outcome is a refusal. What must never happen is a served request.
    try:
        r = httpx.get(
            hardened.url + "/admin/status",
            headers={"Authorization": "Bearer " + "k" * 100_000},
            timeout=30,
        )
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        pass  # the connection was dropped: refused
    else:
        assert 400 <= r.status_code < 500  # uvicorn's header limit or our 401: never served
    assert httpx.get(hardened.url + "/health", timeout=30).status_code == 200


def test_keys_are_compared_in_constant_time(monkeypatch):
    """Every key check goes through hmac.compare_digest on bytes, whatever the token."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    key = auth.SecretStr("the-right-key")
    for token, ok in (("the-right-key", True), ("the-right-kez", False), ("x", False)):
        scope = {
            "type": "http",
            "headers": [(b"authorization", b"Bearer " + token.encode())],
        }
        if ok:
            auth._check(Request(scope), key, "admin")
        else:
            with pytest.raises(auth.Unauthorized):
                auth._check(Request(scope), key, "admin")
    assert [c[1] for c in calls] == [b"the-right-key"] * 3
    assert all(isinstance(a, bytes) for a, _ in calls)


def test_blank_keys_count_as_no_key(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMSPEC_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("MEMSPEC_API_KEY", "")
    monkeypatch.setenv("MEMSPEC_ADMIN_KEY", "   ")
    with pytest.raises(BindRefused):
        check_bind(load_settings(None, {"host": "0.0.0.0"}))
    monkeypatch.setenv("MEMSPEC_API_KEY", "real-key")
    s = load_settings(None, {"host": "0.0.0.0"})
    check_bind(s)  # a real key lets the bind through

    class Ctx:
        settings = s

    admin = auth.admin_key(Ctx())  # a blank admin key falls back to the API key, not to open
    assert admin is not None and admin.get_secret_value() == "real-key"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "my-laptop.example"])
def test_non_loopback_bind_rules(tmp_path, monkeypatch, caplog, host):
    monkeypatch.setenv("MEMSPEC_STATE_DIR", str(tmp_path))
    for var in ("MEMSPEC_API_KEY", "MEMSPEC_ADMIN_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(BindRefused, match="--allow-insecure-bind"):
        check_bind(load_settings(None, {"host": host}))
    with caplog.at_level(logging.WARNING, "memspec.server"):
        check_bind(load_settings(None, {"host": host, "allow_insecure_bind": True}))
    assert "anyone on the network" in caplog.text
    monkeypatch.setenv("MEMSPEC_ADMIN_KEY", "k")
    check_bind(load_settings(None, {"host": host}))


def test_blank_key_non_loopback_start_is_refused(tmp_path):
    """The real command: exits 2 with one line, before binding or loading anything."""
    r = subprocess.run(
        [sys.executable, "-m", "memspec.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": "/usr/bin:/bin",
            "MEMSPEC_STATE_DIR": str(tmp_path),
            "MEMSPEC_API_KEY": "",
            "MEMSPEC_ADMIN_KEY": " ",
        },
    )
    assert r.returncode == 2, r.stderr
    assert "refusing to bind 0.0.0.0" in r.stderr and "Traceback" not in r.stderr


def test_keys_never_logged(hardened):
    """Runs last in this module: the debug-level log of every request above (right keys,
    wrong keys, refused and served) holds neither key nor the wrong tokens."""
    text = hardened.logs()
    assert "401" in text and "/admin/status" in text  # the requests above are in it
    for secret in (API_KEY, ADMIN_KEY, WRONG, "k" * 64):
        assert secret not in text, f"a key appears in the daemon's log: {secret[:6]}..."


def systemd_exposure(unit: Path) -> float | None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        return None
    r = subprocess.run(
        [exe, "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60
    )
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
    return float(m.group(1)) if m else None


def test_systemd_unit_review_is_current():
    """docs/security.md records the unit's `systemd-analyze security` exposure; re-measure it
    where systemd-analyze exists and check the record (and the unit's essentials) hold."""
    unit = ROOT / "systemd" / "memspec.service"
    doc = (ROOT / "docs" / "security.md").read_text()
    recorded = float(re.search(r"overall exposure\s+\*\*([0-9.]+)\*\*", doc).group(1))
    text = unit.read_text()
    for line in (
        "User=memspec",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "CapabilityBoundingSet=\n",
        "IPAddressAllow=localhost",
    ):
        assert line in text, line
        assert line.strip().split("=")[0] in doc, f"{line} not reviewed in docs/security.md"
    measured = systemd_exposure(unit)
    if measured is not None:
        assert measured == recorded, f"exposure now {measured}, docs say {recorded}"
    assert recorded <= 2.0
    rpc = ROOT / "systemd" / "memspec-rpc-worker.service"
    m = re.search(r"memspec-rpc-worker\.service`.*?overall exposure \*\*([0-9.]+)\*\*", doc, re.S)
    assert m, "docs/security.md records no exposure for the rpc-worker unit"
    measured = systemd_exposure(rpc)
    if measured is not None:
        assert measured == float(m.group(1)), f"rpc-worker exposure now {measured}"


def test_ollama_routes_require_the_api_key(hardened):
    """The key guards Ollama's routes as it guards /v1; refusals are in Ollama's body."""
    admin_key = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for method, path, body in OLLAMA_ROUTES:
        for headers in [*refused_headers()[:8], admin_key]:
            r = call(hardened.url, method, path, body, headers)
            assert r.status_code == 401, (path, r.text)
            assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str), r.text
            assert r.headers["www-authenticate"] == "Bearer"
            for secret in (API_KEY, ADMIN_KEY, WRONG):
                assert secret not in r.text
        r = call(hardened.url, method, path, body, hardened.api)
        assert r.status_code == 200, (path, r.text)
    for path in ("/", "/api/version"):  # the probes: no key, nothing but the version
        r = httpx.get(hardened.url + path, timeout=30)
        assert r.status_code == 200 and API_KEY not in r.text
