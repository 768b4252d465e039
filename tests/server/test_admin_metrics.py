"""Admin API (the memspec-ctl contract), auth, live tuning with persistence, /metrics."""

from __future__ import annotations

import json

import httpx
from launcher import ADMIN_KEY, API_KEY, MODEL
from prometheus_client.parser import text_string_to_metric_families

from memspec.memory.huge_pages import huge_page_env

STATUS_KEYS = {
    "version",
    "uptime_s",
    "model",
    "backend",
    "policy",
    "k_max",
    "n_ctx",
    "budget_bytes",
    "used_bytes",
    "memory",
    "queue",
    "tokens_per_s_recent",
    "requests_served",
    "drafts",
}
DRAFT_KEYS = {"id", "kind", "bytes", "resident", "pinned", "acceptance", "requests"}


def test_admin_needs_the_admin_key(server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {API_KEY}"}):
        r = httpx.get(server.url + "/admin/status", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert ADMIN_KEY not in r.text
    r = httpx.post(server.url + "/admin/tune", json={"k_max": 3})
    assert r.status_code == 401
    if not server.external:
        assert ADMIN_KEY not in server.logs(None) and API_KEY not in server.logs(None)


def test_status(admin_http):
    st = admin_http.get("/admin/status").json()
    assert STATUS_KEYS <= set(st)
    assert st["model"] == MODEL and st["backend"] == "llama_cpp" and st["n_ctx"] == 1024
    assert st["used_bytes"]["measured"] > 0 and st["used_bytes"]["modelled"] > 0
    assert st["memory"]["process"]["rss_bytes"] > 0
    assert st["queue"]["depth"] == 0 and st["queue"]["max"] >= 1
    ids = {d["id"] for d in st["drafts"]}
    assert {"prompt-lookup", "q4_0"} <= ids
    for d in st["drafts"]:
        assert DRAFT_KEYS <= set(d)
    # Which kernels run: the CPU backend's features, and the build as setup proved it.
    kernels = st["kernels"]
    assert kernels["batch_invariant"] is True and "CPU" in kernels["features"]
    assert kernels["build"]["probe"]["Q4_0"] == "ok"
    assert kernels["exactness"] == "bitwise" and kernels["target_batch_invariant"] is True
    # The daemon started itself again with malloc on huge pages (memory/huge_pages.py), and
    # its weights and KV caches are on them.
    if kernels["huge_pages"]["thp"] == "madvise" and huge_page_env({}) is not None:
        assert kernels["huge_pages"]["malloc_hugetlb"] is True
        assert kernels["anon_huge_page_bytes"] >= 64 << 20  # SmolLM2 F32: ~540 MB of weights


def test_draft_actions(admin_http):
    def act(draft: str, action: str) -> dict:
        r = admin_http.post(f"/admin/drafts/{draft}/{action}", json={})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ok"] is True and body["draft"]["id"] == draft
        return body["draft"]

    assert act("q2_k", "load")["resident"] is True
    assert act("q2_k", "pin")["pinned"] is True
    r = admin_http.post("/admin/drafts/q2_k/evict", json={})  # pinned: refused with a reason
    assert r.status_code == 400 and "pinned" in r.json()["error"]["message"]
    assert act("q2_k", "unpin")["pinned"] is False
    assert act("q2_k", "evict")["resident"] is False
    listed = admin_http.get("/admin/drafts").json()["drafts"]
    assert {d["id"]: d["resident"] for d in listed}["q2_k"] is False
    r = admin_http.post("/admin/drafts/nope/load", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "draft_not_found"
    assert admin_http.post("/admin/drafts/q2_k/explode", json={}).status_code in (400, 404)


def test_tune_applies_live_and_persists(server, admin_http, state_dir):
    r = admin_http.post("/admin/tune", json={"k_max": 6, "budget": "1.5GiB", "policy": "auto"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"] is True
    s = body["settings"]
    assert s["k_max"] == 6 and s["budget_bytes"] == int(1.5 * 2**30) and s["policy"] == "auto"
    st = admin_http.get("/admin/status").json()
    assert st["k_max"] == 6 and st["budget_bytes"] == int(1.5 * 2**30)
    persisted = not server.external  # an external daemon's state dir is not ours to read
    if persisted:
        saved = json.loads((state_dir / "tuned.json").read_text())
        assert saved == {"budget": "1.5GiB", "policy": "auto", "k_max": 6}
        assert not [p for p in state_dir.iterdir() if p.name.endswith(".tmp")]
    for bad in ({"k_max": -1}, {"budget": "lots"}, {"nope": 1}, {}, {"k_max": "6"}):
        r = admin_http.post("/admin/tune", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert admin_http.get("/admin/status").json()["k_max"] == 6  # refused tunes change nothing
    if persisted:
        assert json.loads((state_dir / "tuned.json").read_text())["k_max"] == 6


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name
            out[key] = s.value
    return out


def test_metrics(server, client):
    before = _samples(httpx.get(server.url + "/metrics").text)
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    after = _samples(text)
    names = {fam.name for fam in text_string_to_metric_families(text)}
    for name in (
        "memspec_requests",
        "memspec_tokens_generated",
        "memspec_rounds",
        "memspec_draft_loads",
        "memspec_budget_bytes",
        "memspec_process_memory_bytes",
        "memspec_queue_depth",
        "memspec_draft_resident_bytes",
        "memspec_draft_predicted_value",
        "memspec_time_to_first_token_seconds",
        "memspec_token_latency_seconds",
    ):
        assert name in names, name
    assert all(n.startswith("memspec_") for n in names)
    assert after["memspec_tokens_generated_total"] > before.get("memspec_tokens_generated_total", 0)
    assert after["memspec_rounds_total"] > before.get("memspec_rounds_total", 0)
    assert after["memspec_time_to_first_token_seconds_count"] >= 1
    key = 'memspec_requests_total{"endpoint": "/v1/completions", "status": "200"}'
    assert after[key] > before.get(key, 0)
    assert after["memspec_budget_bytes"] > 0 and after["memspec_process_memory_bytes"] > 0
    assert after["memspec_draft_loads_total"] >= 2  # the start-up working set
