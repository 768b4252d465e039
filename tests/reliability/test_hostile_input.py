"""Hostile and malformed input against a real daemon: each a 4xx with a clear OpenAI-shaped
message, answered quickly, with the daemon's memory and CPU bounded and serving exactly after.
Limits under test (set small for the shared daemon in conftest.py): max_body 256 KiB,
max_prompt_chars 20000, n_ctx 512; defaults are 1 MiB, 200000 and 2048.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import psutil
import pytest
from launcher import MODEL
from reliability_harness import (
    HARDENED_N_CTX,
    MAX_BODY,
    MAX_PROMPT_CHARS,
    assert_openai_error,
    completion,
    status,
)

pytestmark = pytest.mark.timeout(300)

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
ANSWER_S = 20.0  # each hostile request is answered within this (a busy 2-core box)


@pytest.fixture(scope="module")
def budget(hardened):
    """The daemon's process, CPU time and memory before the hostile requests, and a greedy
    answer to compare with after them."""
    st = status(hardened.url, hardened.admin)
    proc = psutil.Process(st["memory"]["process"]["pid"])
    ref = completion(hardened.url, "The capital of France is", 8, headers=hardened.api)
    return {
        "proc": proc,
        "cpu0": sum(proc.cpu_times()[:2]),
        "rss0": proc.memory_info().rss,
        "ref": ref,
    }


def post(hardened, path: str, raw: bytes | None = None, body=None, **kw) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | hardened.api | kw.pop("headers", {})
    t0 = time.monotonic()
    if raw is not None:
        r = httpx.post(hardened.url + path, content=raw, headers=headers, timeout=60, **kw)
    else:
        r = httpx.post(hardened.url + path, json=body, headers=headers, timeout=60, **kw)
    assert time.monotonic() - t0 < ANSWER_S, f"{path} took {time.monotonic() - t0:.1f}s"
    return r


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2} | extra


def test_oversize_body_413(hardened, budget):
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    err = assert_openai_error(post(hardened, "/v1/completions", body=big), 413, "request_too_large")
    assert str(MAX_BODY) in err["message"]

    def chunks():  # no Content-Length: the limit holds while reading a chunked body
        yield b'{"model": "%s", "prompt": "' % MODEL.encode()
        for _ in range(64):
            yield b"y" * 8192
        yield b'"}'

    r = httpx.post(
        hardened.url + "/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"} | hardened.api,
        timeout=60,
    )
    assert_openai_error(r, 413, "request_too_large")
    # Ollama's routes: the same limit, in Ollama's body.
    r = post(hardened, "/api/generate", body={"prompt": "x" * (MAX_BODY + 10)})
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]


def test_declared_huge_body_is_refused_without_reading_it(hardened, budget):
    """Content-Length of 10 GB and nothing sent: a 413 at once, not a wait for the body."""
    host, port = hardened.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {hardened.api['Authorization'][7:]}\r\n"
            "Content-Length: 10000000000\r\n\r\n{"
        )
        t0 = time.monotonic()
        s.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert time.monotonic() - t0 < 10
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"request_too_large" in data


def test_prompt_over_the_character_limit(hardened, budget):
    long = "word " * (MAX_PROMPT_CHARS // 5 + 10)
    err = assert_openai_error(
        post(hardened, "/v1/completions", body={"model": MODEL, "prompt": long}), 400
    )
    assert err["code"] == "prompt_too_long" and str(MAX_PROMPT_CHARS) in err["message"]
    msgs = [{"role": "user", "content": "x" * 5000}] * 5
    err = assert_openai_error(post(hardened, CHAT, body=chat(messages=msgs)), 400)
    assert err["code"] == "prompt_too_long"
    ids = {"model": MODEL, "prompt": [42] * 30000}  # token ids count too
    assert_openai_error(post(hardened, "/v1/completions", body=ids), 400)


def test_prompt_over_the_context(hardened, budget):
    long = "word " * (HARDENED_N_CTX + 50)  # under the character limit, over 512 tokens
    err = assert_openai_error(
        post(hardened, "/v1/completions", body={"model": MODEL, "prompt": long}),
        400,
        "context_length_exceeded",
    )
    assert str(HARDENED_N_CTX) in err["message"]


@pytest.mark.parametrize(
    "raw,words",
    [
        (b'{"model": "%s", "prompt": "\xff\xfe", "max_tokens": 2}' % MODEL.encode(), "UTF-8"),
        (b"\xc3\x28\xa0\xa1", "UTF-8"),
        (b'{"model": "%s", "prompt": "ok"' % MODEL.encode() + b"\x00" * 8, "JSON"),
        (b'{"model": "%s", "max_tokens": ' % MODEL.encode() + b"9" * 5000 + b"}", "JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (
            b'{"model": "%s", "messages": ' % MODEL.encode() + b"[" * 5000 + b"]" * 5000 + b"}",
            "nested",
        ),
    ],
    ids=[
        "bad-utf8-in-string",
        "bad-utf8",
        "nul-bytes",
        "5000-digit-int",
        "nested-100k",
        "nested-5k",
    ],
)
def test_unparseable_bodies(hardened, budget, raw, words):
    err = assert_openai_error(post(hardened, CHAT, raw=raw), 400)
    assert words.lower() in err["message"].lower(), err


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_completion_tokens": 10**12}, "max_completion_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 1e308}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -(2**64)}, "seed"),
        ({"seed": 2**80}, "seed"),
        ({"n": 10**9}, "n"),
        ({"stop": ["s"] * 5000}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": "x" * 10000}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}] * 2000}, "messages"),
        ({"messages": []}, "messages"),
        ({"user": "u" * 100_000}, "user"),
        ({"logit_bias": {str(i): 1.0 for i in range(5000)}}, "logit_bias"),
    ],
    ids=lambda v: str(v)[:40] if not isinstance(v, dict) else ",".join(f"{k}" for k in v)[:40],
)
def test_out_of_range_values(hardened, budget, extra, param):
    t0 = time.monotonic()
    err = assert_openai_error(post(hardened, CHAT, body=chat(**extra)), 400)
    assert err["param"] == param or (err["param"] or "").startswith(param), err
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_non_finite_numbers(hardened, budget, field, literal):
    raw = json.dumps(chat()).encode()[:-1] + b', "' + field.encode() + b'": ' + literal + b"}"
    err = assert_openai_error(post(hardened, CHAT, raw=raw), 400)
    assert err["param"] == field, err


def test_wrong_content_type_and_empty_body(hardened, budget):
    r = post(hardened, CHAT, raw=b"", headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)
    r = post(
        hardened, CHAT, raw=json.dumps(chat()).encode(), headers={"Content-Type": "text/plain"}
    )
    assert r.status_code in (200, 400), r.text  # FastAPI parses JSON regardless; never a 5xx
    if r.status_code != 200:
        assert_openai_error(r, 400)


def test_bounded_cpu_and_memory_then_exact(hardened, budget):
    """After every hostile request above: little CPU spent, no memory kept, same answer."""
    proc = budget["proc"]
    cpu = sum(proc.cpu_times()[:2]) - budget["cpu0"]
    grown = proc.memory_info().rss - budget["rss0"]
    print(f"\nhostile requests: daemon CPU {cpu:.2f}s, RSS growth {grown / 2**20:.1f} MiB")
    assert cpu < 60, f"hostile requests cost {cpu:.1f}s of CPU"
    assert grown < 128 << 20, f"RSS grew {grown >> 20} MiB"
    assert (
        completion(hardened.url, "The capital of France is", 8, headers=hardened.api)
        == (budget["ref"])
    )
    assert httpx.get(hardened.url + "/health").status_code == 200
