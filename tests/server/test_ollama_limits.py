"""Issue 57 on Ollama's routes, against a real daemon: an invalid model name is a 400 before any
lookup, keep_alive is bounded (no later 500 on /api/ps), embedding requests are bounded and
stop when their client leaves; and (issue 53) null options and hardware hints are accepted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ollama
import pytest
from launcher import MODEL, TARGET_FILE, RawStream, running

from memspec import ollama_name
from memspec.server.embeddings_api import MAX_INPUTS, MAX_TOTAL_TOKENS
from memspec.server.ollama_api import IGNORED_HEADER, NEVER_EXPIRES

pytestmark = pytest.mark.timeout(300)

BAD_NAMES = ["../../etc/passwd", "a" * 5000, "name;rm -rf /", "/etc/passwd", "/abs/model.gguf"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running(tmp_path_factory.mktemp("limits"), "lookup") as d:
        yield d


@pytest.fixture(scope="module")
def http(daemon) -> httpx.Client:
    with httpx.Client(base_url=daemon.url, timeout=120) as c:
        yield c


def log_text(daemon) -> str:
    return Path(daemon.log_path).read_text(errors="replace")


def wait_for_log(daemon, needle: str, timeout: float, after: int = 0) -> tuple[float, str]:
    """(when, the line) the daemon's log first holds `needle` past offset `after`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_text(daemon)[after:]
        if needle in text:
            line = next(ln for ln in text.splitlines() if needle in ln)
            return time.monotonic(), line
        time.sleep(0.02)
    raise AssertionError(f"no {needle!r} in the log within {timeout}s:\n{log_text(daemon)[-3000:]}")


# --- names ---------------------------------------------------------------------------------


def _ask(http: httpx.Client, route: str, name: str) -> httpx.Response:
    if route == "/api/delete":
        return http.request("DELETE", route, json={"model": name})
    body: dict = {"model": name, "stream": False}
    if route == "/api/chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    elif route == "/api/generate":
        body["prompt"] = "hi"
    elif route == "/api/show":
        body = {"model": name}
    elif route == "/api/embed":
        body = {"model": name, "input": "hi"}
    elif route == "/api/embeddings":
        body = {"model": name, "prompt": "hi"}
    return http.post(route, json=body)


ROUTES = [
    "/api/pull",
    "/api/delete",
    "/api/push",
    "/api/show",
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
]


@pytest.mark.parametrize("route", ROUTES)
def test_invalid_names_are_400_before_any_lookup(http, route):
    for name in BAD_NAMES:
        r = _ask(http, route, name)
        assert r.status_code == 400, (route, name[:40], r.status_code, r.text[:300])
        error = r.json()["error"]
        assert isinstance(error, str) and error.startswith("invalid model name"), error
        assert len(error) < 300  # the 5,000 characters are not echoed back


def test_valid_unknown_names_keep_ollamas_answers(http):
    # A registry that does not answer (a closed loopback port; a registry without the model
    # is tests/test_ollama_registry.py's): Ollama's "pull model manifest: ..." error.
    nowhere = "127.0.0.1:9/someone"
    r = http.post(
        "/api/pull", json={"model": f"{nowhere}/llama3:8b", "insecure": True, "stream": False}
    )
    assert r.status_code == 500 and r.json()["error"].startswith("pull model manifest: ")
    r = http.post(
        "/api/pull", json={"model": f"{nowhere}/model:Q4_0", "insecure": True}
    )  # streamed
    assert r.status_code == 200 and '"error": "pull model manifest' in r.text
    assert http.request("DELETE", "/api/delete", json={"model": "nope:1b"}).status_code == 404
    for route in ("/api/show", "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"):
        r = _ask(http, route, "nope")
        assert r.status_code == 404 and "nope" in r.json()["error"], (route, r.text)


def test_every_served_name_is_still_valid_and_resolves(http):
    names = [m["name"] for m in http.get("/api/tags").json()["models"]]
    assert MODEL in names
    for n in names:
        ollama_name.parse(n)  # whatever the daemon lists, Ollama's rules accept
    stem = TARGET_FILE.removesuffix(".gguf")
    for n in (MODEL, TARGET_FILE, stem, f"{stem}:latest", f"library/{MODEL}",
              f"registry.ollama.ai/library/{MODEL}"):  # fmt: skip
        r = http.post("/api/show", json={"model": n})
        assert r.status_code == 200, (n, r.text[:200])


# --- keep_alive ----------------------------------------------------------------------------


def _status_answers(http: httpx.Client) -> list[dict]:
    ps = http.get("/api/ps")
    assert ps.status_code == 200, ps.text[:500]
    assert http.get("/admin/status").status_code == 200
    return ps.json()["models"]


@pytest.mark.parametrize(
    "raw",
    ['"9999999999999h"', "-1", "1e400", '"-9999999999h"', "1" + "0" * 40, "-1e400", '"1e400"'],
)
def test_keep_alive_extremes_mean_no_expiry(http, raw):
    body = f'{{"model": "{MODEL}", "prompt": "", "keep_alive": {raw}}}'
    r = http.post("/api/generate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text[:300]
    (row,) = [m for m in _status_answers(http) if m["name"] == MODEL]
    assert row["expires_at"] == NEVER_EXPIRES
    # The same through a generation (its keep_alive applies when it ends).
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 1},
        "stream": False,
    }
    body = json.dumps(chat)[:-1] + f', "keep_alive": {raw}}}'
    r = http.post("/api/chat", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    (row,) = [m for m in _status_answers(http) if m["name"] == MODEL]
    assert row["expires_at"] == NEVER_EXPIRES


@pytest.mark.parametrize("value", ["inf", "nan", "soon", "1" * 5000, "5" * 70 + "h"])
def test_malformed_keep_alive_is_a_400(http, value):
    r = http.post("/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": value})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    assert len(r.json()["error"]) < 300
    r = http.post("/api/embed", json={"model": MODEL, "input": "x", "keep_alive": value})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]


def test_ctl_status_renders_after_the_extremes(http, daemon):
    r = http.post("/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": "99999999h"})
    assert r.status_code == 200
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSPEC_")}
    cmd = [sys.executable, "-m", "memspec.ctl", "--url", daemon.url, "status"]
    for extra in ([], ["--json"]):
        p = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        if not extra:
            assert "no expiry" in p.stdout, p.stdout


# --- embeddings ----------------------------------------------------------------------------


def test_too_many_inputs_is_a_fast_400(http):
    inputs = [f"x{i}" for i in range(100_000)]
    t0 = time.monotonic()
    r = http.post("/api/embed", json={"model": MODEL, "input": inputs})
    elapsed = time.monotonic() - t0
    assert r.status_code == 400 and str(MAX_INPUTS) in r.json()["error"], r.text[:300]
    assert elapsed < 3.0, elapsed
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": inputs[: MAX_INPUTS + 1]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input" and str(MAX_INPUTS) in err["message"]
    assert err["code"] == "too_many_inputs"


def test_too_many_tokens_is_a_400_naming_the_limit(http):
    per = MAX_TOTAL_TOKENS // MAX_INPUTS + 1  # 2,048 inputs of 147 token ids: 301,056 tokens
    body = json.dumps({"model": MODEL, "input": [[1] * per] * MAX_INPUTS}, separators=(",", ":"))
    r = http.post("/v1/embeddings", content=body, headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and str(MAX_TOTAL_TOKENS) in err["message"], r.text[:300]
    assert err["code"] == "too_many_tokens"


def test_embedding_stops_when_its_client_leaves(http, daemon):
    # 1,500 distinct inputs of ~30 tokens: tens of seconds of work on one thread.
    n = 1500
    texts = [f"Sentence {i} says the weather on day {i} was mild, with rain." for i in range(n)]
    offset = len(log_text(daemon))
    stream = RawStream(daemon.url, "/api/embed", {"model": MODEL, "input": texts})
    try:
        wait_for_log(daemon, f"embedding {n} inputs", 60, offset)
        time.sleep(0.3)  # some inputs computed: the work is under way
    finally:
        stream.close()
    left = time.monotonic()
    stopped, line = wait_for_log(daemon, "embedding stopped: the client left", 10, offset)
    done = int(line.split("after ")[1].split(" of ")[0])
    assert 0 < done < n, line
    assert stopped - left < 1.5, (stopped - left, line)
    # Nothing of it is left running: a small request is answered at once.
    t0 = time.monotonic()
    r = http.post("/api/embed", json={"model": MODEL, "input": "hello"})
    assert r.status_code == 200 and time.monotonic() - t0 < 2.0


# --- options (issue 53) --------------------------------------------------------------------

LANGCHAIN_OPTIONS = {  # what langchain-ollama sends: every option, the unset ones null
    "mirostat": None,
    "mirostat_eta": None,
    "mirostat_tau": None,
    "num_ctx": None,
    "num_gpu": None,
    "num_thread": 2,
    "num_predict": 4,
    "repeat_last_n": None,
    "repeat_penalty": None,
    "temperature": 0,
    "seed": None,
    "stop": None,
    "tfs_z": None,
    "top_k": None,
    "top_p": None,
}


def test_null_options_and_hardware_hints_raw(http, daemon):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    r = http.post("/api/chat", json=chat | {"options": LANGCHAIN_OPTIONS})
    assert r.status_code == 200, r.text[:300]
    assert r.headers[IGNORED_HEADER] == "num_thread"
    assert r.json()["eval_count"] <= 4
    hints = {"num_thread": 2, "num_gpu": 0, "main_gpu": 0, "num_batch": 8, "use_mmap": True,
             "numa": False, "low_vram": False, "use_mlock": False, "f16_kv": True,
             "vocab_only": False, "logits_all": False, "num_predict": 2}  # fmt: skip
    with http.stream("POST", "/api/generate", json={"model": MODEL, "prompt": "hi",
                                                    "options": hints}) as s:  # fmt: skip
        assert s.status_code == 200
        names = s.headers[IGNORED_HEADER].split(",")
        s.read()
    assert sorted(names) == sorted(k for k in hints if k != "num_predict")
    r = http.post("/api/embed", json={"model": MODEL, "input": "x", "options": LANGCHAIN_OPTIONS})
    assert r.status_code == 200 and r.headers[IGNORED_HEADER] == "num_thread"
    # Without hints, no header; an option that changes the output is still refused.
    r = http.post("/api/chat", json=chat | {"options": {"num_predict": 1}})
    assert r.status_code == 200 and IGNORED_HEADER not in r.headers
    for bad in ({"mirostat": 1}, {"tfs_z": 0.5}):
        r = http.post("/api/chat", json=chat | {"options": bad})
        assert r.status_code == 400 and next(iter(bad)) in r.json()["error"]
    assert "ignoring Ollama options num_thread" in log_text(daemon)


def test_hardware_hints_through_the_ollama_client(daemon):
    oc = ollama.Client(host=daemon.url)
    r = oc.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        options={"num_thread": 2, "num_gpu": 0, "use_mmap": True, "num_predict": 3, "top_k": None},
    )
    assert r.done and r.eval_count <= 3
    g = oc.generate(model=MODEL, prompt="The sky is", options={"num_batch": 16, "num_predict": 2})
    assert g.done
    e = oc.embed(model=MODEL, input="hi", options={"num_thread": 2})
    assert len(e.embeddings) == 1
