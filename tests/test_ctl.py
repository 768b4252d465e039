"""`memspec-ctl` as a real process against a real HTTP server speaking the admin API contract.

The server here is a FAKE: a tiny FastAPI app on uvicorn (real sockets, real HTTP, real SSE
streaming) that serves the admin contract with canned data. That is acceptable only because
the thing under test is the client: exit codes, one-line errors, tables, --json, watch and
bench, including answers a live daemon cannot be made to give on demand (429 bursts, 500s,
409 on a pinned draft). The same commands run against the real `memspec serve` in
test_ctl_live.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from memspec.units import parse_size

KEY = "s3cret-admin-key"
pytestmark = pytest.mark.timeout(60)

DRAFTS = [
    {
        "id": "prompt-lookup",
        "kind": "prompt_lookup",
        "bytes": 0,
        "resident": True,
        "pinned": True,
        "acceptance": 0.41,
        "requests": 12,
    },
    {
        "id": "q4_0",
        "kind": "model",
        "bytes": 92_000_000,
        "resident": True,
        "pinned": False,
        "acceptance": 0.9312,
        "requests": 7,
    },
    {
        "id": "q2_k",
        "kind": "model",
        "bytes": 61_500_000,
        "resident": False,
        "pinned": False,
        "acceptance": 0.55,
        "requests": 0,
    },
]
SETTINGS = {"budget": "2GiB", "policy": "auto", "k_max": 8, "n_ctx": 2048}
POLICIES = {"auto", "fixed", "none", "bandit"}
QUEUE_MAX = 2  # small, so a concurrent bench sees 429s


def _err(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param}}
    body["error"]["code"] = code
    return JSONResponse(body, status_code=status)


class FakeDaemon:
    """Canned state behind the contract; every request is logged for assertions."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.reset()
        self._routes()

    def reset(self) -> None:
        self.drafts = copy.deepcopy(DRAFTS)
        self.settings = dict(SETTINGS)
        self.log: list[tuple[str, str, Any]] = []
        self.in_flight = 0
        self.served = 100

    def status(self) -> dict[str, Any]:
        resident = sum(d["bytes"] for d in self.drafts if d["resident"])
        return {
            "version": "0.1.0",
            "uptime_s": 3725.4,
            "model": "smollm2-135m",
            "backend": "llama_cpp",
            "policy": self.settings["policy"],
            "k_max": self.settings["k_max"],
            "n_ctx": self.settings["n_ctx"],
            "budget_bytes": parse_size(self.settings["budget"]),
            "used_bytes": {"measured": 700_000_000 + resident, "modelled": 650_000_000 + resident},
            "memory": {
                "system": {"total_bytes": 8_000_000_000, "available_bytes": 3_500_000_000},
                "process": {"pid": 1, "rss_bytes": 800_000_000, "uss_bytes": 760_000_000},
                "nvmap_used_bytes": 1_200_000_000,
                "jetson": {"l4t": "36.4.0", "jetpack": "6.1", "model": "Orin Nano"},
                "cuda": None,
            },
            "queue": {"depth": self.in_flight, "max": QUEUE_MAX},
            "tokens_per_s_recent": 51.73,
            "requests_served": self.served,
            "drafts": self.drafts,
        }

    def _routes(self) -> None:
        app = self.app

        @app.middleware("http")
        async def auth_and_log(request: Request, call_next):
            body = await request.body()
            self.log.append((request.method, request.url.path, json.loads(body) if body else None))
            if request.url.path.startswith("/admin/"):
                if request.headers.get("authorization") != f"Bearer {KEY}":
                    return JSONResponse(
                        {
                            "error": {
                                "message": "invalid or missing admin key",
                                "type": "authentication_error",
                                "param": None,
                                "code": "invalid_api_key",
                            }
                        },
                        status_code=401,
                    )
            return await call_next(request)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/admin/status")
        async def status():
            self.served += 1  # so watch shows a delta
            return self.status()

        @app.get("/admin/drafts")
        async def drafts():
            return {"drafts": self.drafts}

        @app.post("/admin/drafts/{draft_id}/{action}")
        async def draft_action(draft_id: str, action: str):
            d = next((d for d in self.drafts if d["id"] == draft_id), None)
            if d is None:
                return _err(404, f"draft {draft_id!r} not found", "draft_not_found", "id")
            if action == "load":
                d["resident"] = True
            elif action == "evict":
                if d["pinned"]:
                    return _err(409, f"draft {draft_id!r} is pinned", "draft_pinned", "id")
                d["resident"] = False
            elif action in ("pin", "unpin"):
                d["pinned"] = action == "pin"
                d["resident"] = d["resident"] or d["pinned"]
            else:
                return _err(404, f"unknown action {action!r}", "not_found")
            return {"ok": True, "draft": d}

        @app.post("/admin/tune")
        async def tune(request: Request):
            body = await request.json()
            if "policy" in body and body["policy"] not in POLICIES:
                return _err(400, f"unknown policy {body['policy']!r}", "invalid_value", "policy")
            if "budget" in body:
                parse_size(body["budget"])
            self.settings.update(body)
            return {"ok": True, "settings": dict(self.settings)}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "smollm2-135m", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            if body.get("prompt") == "boom":
                return JSONResponse(
                    {"error": {"message": "engine failed", "type": "server_error"}},
                    status_code=500,
                )
            if self.in_flight >= QUEUE_MAX:
                resp = _err(429, "queue full", "queue_full")
                resp.headers["Retry-After"] = "1"
                return resp
            self.in_flight += 1
            n = int(body.get("max_tokens", 16))

            async def stream():
                try:
                    for i in range(n):
                        chunk = {"object": "text_completion", "choices": [{"text": f" t{i}"}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        await asyncio.sleep(0.01)
                    usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1
                    self.served += 1

            return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake() -> FakeDaemon:
    daemon = FakeDaemon()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before the server starts: no free-port race
    server = uvicorn.Server(uvicorn.Config(daemon.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    daemon.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield daemon
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(autouse=True)
def _reset(request):
    if "fake" in request.fixturenames:
        request.getfixturevalue("fake").reset()


def ctl(*args: str, url: str | None = None, key: str | None = KEY, timeout: float = 30):
    """Run the real `memspec-ctl` entry point in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    cmd = [sys.executable, "-m", "memspec.ctl"]
    if url:
        cmd += ["--url", url]
    if key:
        cmd += ["--key", key]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- status ------------------------------------------------------------------------------


def test_status_table(fake):
    p = ctl("status", url=fake.url)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for needle in (
        "budget",
        "2.00 GiB",
        "measured",
        "modelled",
        "auto",
        "smollm2-135m (llama_cpp)",
        "51.7",
        "L4T 36.4.0, JetPack 6.1",
        "1h02m",
    ):
        assert needle in out, (needle, out)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("DRAFT"))
    rows = lines[header + 1 : header + 4]
    assert [r.split()[0] for r in rows] == ["prompt-lookup", "q4_0", "q2_k"]
    # Aligned columns: every row has its KIND and RESIDENT cells where the headers are.
    for col in ("KIND", "RESIDENT"):
        at = lines[header].index(col)
        assert all(r[at - 1] == " " and r[at] != " " for r in rows), (col, rows)
    assert "0.93" in rows[1] and "87.74 MiB" in rows[1]


def test_key_from_env(fake):
    env = {**os.environ, "MEMSPEC_URL": fake.url, "MEMSPEC_ADMIN_KEY": KEY}
    p = subprocess.run(
        [sys.executable, "-m", "memspec.ctl", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model"] == "smollm2-135m"


def test_unauthorized(fake):
    line = assert_one_line_error(ctl("status", url=fake.url, key=None), 4, "401")
    assert "--key" in line
    assert_one_line_error(ctl("status", url=fake.url, key="wrong"), 4, "401", "rejected")


def test_server_down():
    url = f"http://127.0.0.1:{free_port()}"
    assert_one_line_error(ctl("status", url=url), 3, "cannot connect", "refused")
    assert_one_line_error(ctl("drafts", "load", "q4_0", url=url), 3, "refused")


def test_not_a_memspec_daemon(fake):
    # A server that is up but has no admin API there (wrong path): the 404 is reported.
    assert_one_line_error(ctl("status", url=fake.url + "/elsewhere"), 1, "404")


def test_usage_errors_are_one_line(fake):
    assert_one_line_error(ctl("--url", "nota-url", "status"), 2, "not an http(s) URL")
    assert_one_line_error(ctl("drafts", url=fake.url), 2)
    assert_one_line_error(ctl("tune", "k-max", "-1", url=fake.url), 2, "K_MAX")
    assert fake.log == []  # nothing was sent


# --- drafts ------------------------------------------------------------------------------


def test_drafts_list(fake):
    p = ctl("drafts", "list", url=fake.url)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].split() == [
        "DRAFT",
        "KIND",
        "SIZE",
        "RESIDENT",
        "PINNED",
        "ACCEPT",
        "VALUE",
        "REQUESTS",
    ]
    p = ctl("drafts", "list", "--json", url=fake.url)
    assert [d["id"] for d in json.loads(p.stdout)["drafts"]] == ["prompt-lookup", "q4_0", "q2_k"]


def test_drafts_load_evict_pin_unpin(fake):
    p = ctl("drafts", "load", "q2_k", url=fake.url)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("loaded q2_k:") and "resident yes" in p.stdout
    p = ctl("drafts", "pin", "q2_k", "--json", url=fake.url)
    assert json.loads(p.stdout) == {"ok": True, "draft": fake.drafts[2]}
    assert fake.drafts[2]["pinned"] is True
    # Evicting a pinned draft: the daemon's 409 and its reason, one line, exit 1.
    assert_one_line_error(ctl("drafts", "evict", "q2_k", url=fake.url), 1, "pinned", "409")
    assert ctl("drafts", "unpin", "q2_k", url=fake.url).returncode == 0
    p = ctl("drafts", "evict", "q2_k", url=fake.url)
    assert p.returncode == 0 and "evicted q2_k" in p.stdout
    assert fake.drafts[2] == {**DRAFTS[2], "resident": False, "pinned": False}
    posts = [path for method, path, _ in fake.log if method == "POST"]
    assert posts == [
        "/admin/drafts/q2_k/load",
        "/admin/drafts/q2_k/pin",
        "/admin/drafts/q2_k/evict",
        "/admin/drafts/q2_k/unpin",
        "/admin/drafts/q2_k/evict",
    ]


# --- tune --------------------------------------------------------------------------------


def test_tune(fake):
    p = ctl("tune", "budget", "1.5GiB", url=fake.url)
    assert p.returncode == 0, p.stderr
    assert "budget" in p.stdout and "1.5GiB" in p.stdout
    p = ctl("tune", "k-max", "4", "--json", url=fake.url)
    assert json.loads(p.stdout)["settings"]["k_max"] == 4
    assert ctl("tune", "n-ctx", "4096", url=fake.url).returncode == 0
    assert ctl("tune", "policy", "fixed", url=fake.url).returncode == 0
    bodies = [body for method, path, body in fake.log if path == "/admin/tune"]
    # The size goes as written (the daemon persists it), numbers as JSON ints.
    assert bodies == [{"budget": "1.5GiB"}, {"k_max": 4}, {"n_ctx": 4096}, {"policy": "fixed"}]
    st = json.loads(ctl("status", "--json", url=fake.url).stdout)
    assert st["budget_bytes"] == int(1.5 * 1024**3) and st["policy"] == "fixed"


def test_tune_errors(fake):
    assert_one_line_error(ctl("tune", "budget", "1.5XB", url=fake.url), 2, "not a size")
    assert_one_line_error(ctl("tune", "budget", "0", url=fake.url), 2, "> 0")
    assert fake.log == []  # a bad size is caught before anything is sent
    assert_one_line_error(
        ctl("tune", "policy", "bogus", url=fake.url), 1, "unknown policy 'bogus'", "400"
    )


# --- watch -------------------------------------------------------------------------------


def test_watch_count(fake):
    p = ctl("watch", "--interval", "0.1", "--count", "3", url=fake.url)
    assert p.returncode == 0, p.stderr
    frames = [line for line in p.stdout.splitlines() if line.startswith("--- ")]
    assert len(frames) == 3
    assert p.stdout.count("DRAFT") == 3
    assert "(+1)" in p.stdout  # requests served grew between frames
    assert len([m for m, path, _ in fake.log if path == "/admin/status"]) == 3


def test_watch_server_down():
    url = f"http://127.0.0.1:{free_port()}"
    p = ctl("watch", "--interval", "0.1", "--count", "2", url=url)
    assert p.returncode == 3
    assert "Traceback" not in p.stderr
    assert p.stderr.count("connection refused") == 2  # one line per failed refresh


# --- bench -------------------------------------------------------------------------------


def test_bench_json(fake):
    p = ctl(
        "bench",
        "--requests",
        "4",
        "--concurrency",
        "2",
        "--max-tokens",
        "8",
        "--prompt",
        "hello",
        "--json",
        url=fake.url,
    )
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["ok"] == 4 and rep["errors"] == 0 and rep["rejected_429"] == 0
    assert rep["tokens"] == 32 and rep["model"] == "smollm2-135m"
    for key in ("ttft_s", "latency_s", "tokens_per_s"):
        assert set(rep[key]) == {"p50", "p90", "p99", "mean"}
        assert rep[key]["p50"] > 0
    # 8 chunks 10 ms apart: the first token arrives well before the end.
    assert rep["ttft_s"]["p50"] < rep["latency_s"]["p50"]
    assert rep["latency_s"]["p50"] >= 0.07
    sent = [body for method, path, body in fake.log if path == "/v1/completions"]
    assert len(sent) == 4
    assert all(b["stream"] and b["max_tokens"] == 8 and b["prompt"] == "hello" for b in sent)


def test_bench_table_and_429(fake):
    p = ctl("bench", "--requests", "6", "--concurrency", "6", "--max-tokens", "20", url=fake.url)
    # Over the fake's queue of 2: some requests are turned away with 429, reported, not fatal.
    assert p.returncode == 0, p.stderr
    head = p.stdout.splitlines()[1]
    ok = int(head.split("ok ")[1].split()[0])
    rejected = int(head.split("429 ")[1].split()[0])
    assert ok >= 1 and rejected >= 1 and ok + rejected == 6, head
    assert "ttft (ms)" in p.stdout and "P99" in p.stdout


def test_bench_errors(fake):
    p = ctl("bench", "--requests", "2", "--prompt", "boom", url=fake.url)
    assert_one_line_error(p, 1, "bench: 2 of 2 failed", "HTTP 500")


def test_bench_loopback_only():
    p = ctl("bench", url="http://192.0.2.1:8000")  # TEST-NET-1: never contacted
    assert_one_line_error(p, 2, "loopback")


def test_bench_server_down():
    url = f"http://127.0.0.1:{free_port()}"
    assert_one_line_error(ctl("bench", url=url), 3, "refused")


def test_drafts_table_says_why_a_draft_is_left_out():
    from memspec.ctl.render import drafts_table

    reason = "built for a gpt2 tokenizer of 49152 tokens (fingerprint 35a59a1a); ..."
    rows = [
        {"id": "prompt-lookup", "kind": "prompt_lookup", "bytes": 0, "compatible": True},
        {"id": "q4_0", "kind": "model", "bytes": 0, "compatible": False, "reason": reason},
    ]
    lines = drafts_table(rows).splitlines()
    assert [r.split()[0] for r in lines[1:3]] == ["prompt-lookup", "q4_0"]
    assert lines[-2:] == ["not usable with this target (tokenizer):", f"  q4_0: {reason}"]
    assert "not usable" not in drafts_table(rows[:1])


def test_status_lists_the_devices_of_a_split_target():
    from memspec.ctl import render

    devices = [
        {"device": "local", "layers": 11, "bytes": 200 * 2**20},
        {"device": "10.0.0.2:50052", "layers": 10, "bytes": 170 * 2**20, "state": "lost"},
    ]
    out = render.status({"devices": devices}, "http://x")
    assert "local: 11 layers, 200.00 MiB" in out
    assert "10.0.0.2:50052: 10 layers, 170.00 MiB   lost" in out
    assert "device" not in render.status({"devices": devices[:1]}, "http://x")  # one device


def test_status_shows_the_context_trade_and_tune_takes_auto():
    """The context per slot against the drafts resident and the slots (n_ctx auto's trade);
    `tune n-ctx auto`, `tune prefill-chunk`, `tune context-overflow` parse as the daemon
    takes them."""
    from memspec.ctl import render
    from memspec.ctl.main import build_parser

    context = {
        "n_ctx": 5888, "auto": True, "slots": 1, "drafts": ["prompt-lookup", "q2_k"],
        "drafts_bytes": 213 * 2**20, "trained_context": 8192, "longest": 5888,
        "limited_by": "budget", "without_drafts": 8192,
    }  # fmt: skip
    out = render.status({"n_ctx": 5888, "working_set": {"context": context}}, "http://x")
    assert (
        "5,888 per slot x 1 slot beside prompt-lookup, q2_k (213.00 MiB); auto, limit budget "
        "(trained 8,192); 8,192 with no draft"
    ) in out
    fixed = {**context, "auto": False, "n_ctx": 2048}
    assert "auto would give 5,888" in render.status({"working_set": {"context": fixed}}, "x")
    parse = build_parser().parse_args
    assert parse(["tune", "n-ctx", "auto"]).value == "auto"
    assert parse(["tune", "n-ctx", "4096"]).value == 4096
    assert parse(["tune", "prefill-chunk", "128"]).value == 128
    assert parse(["tune", "context-overflow", "shift"]).field == "context_overflow"
    for bad in (["tune", "n-ctx", "8"], ["tune", "context-overflow", "cut"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_status_says_which_resident_model_is_still_calibrating():
    """A model served before its costs were measured decodes plain until they land (its
    calibration runs while the engine is idle): status says so beside it."""
    from memspec.ctl import render

    row = {"name": "new:1b", "resident": True, "bytes": 2**30, "expires_at": None, "loads": 1}
    models = [
        row | {"calibration": "calibrating"},
        row | {"name": "old:1b"} | {"calibration": "calibrated"},
    ]
    out = render.status({"models": models}, "http://x")
    assert "new:1b: resident 1.00 GiB, no expiry, calibrating;" in out
    assert "old:1b: resident 1.00 GiB, no expiry;" in out
