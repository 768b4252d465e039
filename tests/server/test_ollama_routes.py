"""Every route of Ollama's table (server/routes.go GenerateRoutes) is answered, honoured or
refused, never a bare 404 or 405 (docs/ollama.md, "Routes"); the ones memspec/server/
ollama_extra.py adds answer as Ollama does with its cloud turned off. A key-less app whose
engine never started: the model routes answer 503 (loading), which is not what is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

DIGEST = "sha256:" + "a" * 64

# (method, path) of every /api route in Ollama's GenerateRoutes (v0.6.8 and after).
OLLAMA_ROUTES = [
    ("HEAD", "/"),
    ("GET", "/"),
    ("HEAD", "/api/version"),
    ("GET", "/api/version"),
    ("GET", "/api/status"),
    ("POST", "/api/pull"),
    ("POST", "/api/push"),
    ("HEAD", "/api/tags"),
    ("GET", "/api/tags"),
    ("POST", "/api/show"),
    ("DELETE", "/api/delete"),
    ("POST", "/api/me"),
    ("POST", "/api/signout"),
    ("DELETE", "/api/user/keys/c29tZS1rZXk"),
    ("POST", "/api/create"),
    ("POST", f"/api/blobs/{DIGEST}"),
    ("HEAD", f"/api/blobs/{DIGEST}"),
    ("POST", "/api/copy"),
    ("POST", "/api/experimental/web_search"),
    ("POST", "/api/experimental/web_fetch"),
    ("GET", "/api/experimental/model-recommendations"),
    ("GET", "/api/ps"),
    ("POST", "/api/generate"),
    ("POST", "/api/chat"),
    ("POST", "/api/embed"),
    ("POST", "/api/embeddings"),
]


@pytest.fixture
def client(tmp_path: Path):  # -> TestClient
    from fastapi.testclient import TestClient

    from memspec import paths
    from memspec.config import Settings
    from memspec.server.app import create_app

    paths.use_data_dir(tmp_path)  # conftest puts the process's data dir back after the test
    return TestClient(create_app(Settings(host="127.0.0.1")), base_url="http://127.0.0.1:8000")


def test_every_ollama_route_is_answered(client) -> None:
    for method, path in OLLAMA_ROUTES:
        body = {} if method in ("POST", "DELETE") and "/blobs/" not in path else None
        r = client.request(method, path, json=body)
        assert r.status_code not in (404, 405) or path.startswith("/api/blobs/"), (
            method,
            path,
            r.status_code,
            r.text,
        )
        if r.status_code == 404:  # HEAD of a blob this store lacks: Ollama's 404 too
            assert method == "HEAD"


def test_probes_status_and_cloud_routes_as_ollama_with_its_cloud_off(client) -> None:
    assert client.head("/api/version").status_code == 200
    assert client.head("/api/tags").status_code == 503  # as GET /api/tags while loading
    assert client.get("/api/tags").status_code == 503
    assert client.get("/api/status").json() == {"cloud": {"disabled": True, "source": "config"}}
    refused = {
        ("POST", "/api/me"): "ollama.com account is unavailable",
        ("POST", "/api/signout"): "ollama.com account is unavailable",
        ("DELETE", "/api/user/keys/abc"): "ollama.com account is unavailable",
        ("POST", "/api/experimental/web_search"): "web search is unavailable",
        ("POST", "/api/experimental/web_fetch"): "web fetch is unavailable",
        ("GET", "/api/experimental/model-recommendations"): "model recommendations are unavailable",
    }
    for (method, path), operation in refused.items():
        r = client.request(method, path)
        assert r.status_code == 403, (path, r.text)
        assert r.json() == {"error": f"ollama cloud is disabled: {operation}"}


def test_the_refusals_keep_the_api_key(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from memspec import paths
    from memspec.config import Settings
    from memspec.server.app import create_app

    paths.use_data_dir(tmp_path)
    app = create_app(Settings(host="127.0.0.1", api_key="k" * 32))
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    assert client.post("/api/experimental/web_search").status_code == 401
    assert client.head("/api/tags").status_code == 401
    assert client.get("/api/status").status_code == 200  # open, as /api/version
    assert client.head("/api/version").status_code == 200
    keyed = {"Authorization": "Bearer " + "k" * 32}
    assert client.post("/api/experimental/web_search", headers=keyed).status_code == 403
