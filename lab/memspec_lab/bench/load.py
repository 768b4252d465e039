"""Load and soak runs against a running daemon, over loopback: `memspec bench load|soak`.

    memspec bench load --url URL --clients 32 --seconds 120 --out load.json
    memspec bench soak --url URL --minutes 30 --out soak.json [--max-growth 64MiB]

load: N streaming clients for a bounded time. Every greedy answer must be complete and identical
to the same request run alone (first, one at a time, with plain target decoding: by the lossless
contract every draft must give exactly that text); a full queue must answer 429 with
Retry-After and an OpenAI-shaped body, never a 5xx or a hang. Reports latency percentiles,
tokens/s, and the daemon's memory (its own /admin/status and psutil) against its budget.

soak: a mix for a long time: multi-turn chat sessions (KV reuse, prefix cache), completions
with every draft, streaming and not, clients that hang up mid-stream, malformed requests, admin
and metrics scrapes. Memory is sampled throughout; after a warm-up the process may not grow by
more than --max-growth beyond what its bounded caches (the prefix cache, capped at its
capacity) account for, and threads, file descriptors and metric series must stay flat. Every
greedy request that repeats must give the same text every time.

Both exit 0 when every check passes, 1 otherwise; the JSON report says which check failed.
Only loopback URLs are accepted: this is a load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from memspec.ctl.client import async_client, bearer, delta_text, dist, stream_completion
from memspec.net import is_loopback
from memspec.units import format_size, parse_size

# Short prompts that make the 135M testbed model write (not stop at once); real questions for chat.
COMPLETION_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The three most important things to know about Python lists are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Alice met Bob and Carol at the station. Then Alice and Carol took the train to",
]
CHAT_PROMPTS = [
    "What are three benefits of regular exercise?",
    "Extract the names from this sentence: Alice met Bob and Carol at the station.",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
]
FOLLOW_UPS = ["Tell me more.", "Summarise that in one sentence.", "Give an example."]
DRAFTS = ["auto", "none", "prompt-lookup", "q4_0"]


# --- one request ------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request got back, classified."""

    status: str  # ok | rejected | client_error | server_error | transport | timeout | incomplete
    http_status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    retry_after_s: float | None = None
    error: str | None = None
    error_shaped: bool = True  # an error body is {"error": {message, type, param, code}}


def openai_error_shaped(body: Any) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
    )


def _error_outcome(resp: httpx.Response, t0: float) -> Outcome:
    try:
        body = json.loads(resp.content)
    except ValueError:
        body = None
    shaped = openai_error_shaped(body)
    msg = body["error"]["message"] if shaped else resp.content[:200].decode(errors="replace")
    code = resp.status_code
    status = "rejected" if code == 429 else "server_error" if code >= 500 else "client_error"
    retry = resp.headers.get("retry-after")
    return Outcome(
        status,
        code,
        latency_s=time.perf_counter() - t0,
        retry_after_s=float(retry) if retry and retry.isdigit() else None,
        error=f"HTTP {code}: {msg}",
        error_shaped=shaped and (code != 429 or retry is not None),
    )


async def _request(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Outcome:
    """One completion; a stream must end with a finish_reason and [DONE] to be complete."""
    t0 = time.perf_counter()
    try:
        if body.get("stream"):
            resp, s = await stream_completion(http, path, body)
        else:
            resp, s = await http.post(path, json=body), None
        if resp.status_code != 200:
            return _error_outcome(resp, t0)
        if s is None:  # a whole answer
            obj = resp.json()
            text, finish = delta_text(obj)
            return Outcome(
                "ok" if finish else "incomplete",
                text=text,
                finish_reason=finish,
                tokens=int((obj.get("usage") or {}).get("completion_tokens") or 0),
                ttft_s=(obj.get("memspec") or {}).get("ttft_s"),
                latency_s=time.perf_counter() - t0,
            )
    except httpx.TimeoutException:
        return Outcome("timeout", error="timed out", latency_s=time.perf_counter() - t0)
    except (httpx.HTTPError, ValueError) as e:
        return Outcome(
            "transport", error=f"{type(e).__name__}: {e}", latency_s=time.perf_counter() - t0
        )
    if s.error is not None:  # an engine error mid-stream: a 5xx in all but status
        return Outcome(
            "server_error",
            200,
            text=s.text,
            ttft_s=s.ttft_s,
            error=f"in stream: {s.error['error']}",
            error_shaped=openai_error_shaped(s.error),
        )
    complete = bool(s.done and s.finish_reason)
    missing = "finish_reason" if s.done else "[DONE]"
    return Outcome(
        "ok" if complete else "incomplete",
        200,
        text=s.text,
        finish_reason=s.finish_reason,
        tokens=s.usage_tokens or 0,
        ttft_s=s.ttft_s,
        latency_s=s.latency_s,
        error=None if complete else f"stream ended without {missing}",
    )


async def _bounded(coro: Any, seconds: float) -> Outcome:
    """A request that takes longer than `seconds` in all (not per read) is a hang."""
    try:
        return await asyncio.wait_for(coro, seconds)
    except asyncio.TimeoutError:
        return Outcome("timeout", error=f"no complete answer in {seconds:g}s", latency_s=seconds)


# --- the daemon's memory ------------------------------------------------------------------------


@dataclass
class MemSample:
    t: float
    rss: int | None  # psutil, from outside the daemon
    measured: int | None  # /admin/status used_bytes.measured (what the daemon says)
    modelled: int | None
    prefix_cache: int | None
    prefix_cache_capacity: int | None
    threads: int | None
    fds: int | None
    metric_series: int | None = None


class Daemon:
    """The daemon under load: its status (admin key) and its process (psutil, same host)."""

    def __init__(self, http: httpx.AsyncClient, admin_headers: dict[str, str]):
        self.http = http
        self.admin_headers = admin_headers
        self.proc: Any = None
        self.budget: int | None = None
        self.status_error: str | None = None

    async def status(self) -> dict[str, Any] | None:
        try:
            r = await self.http.get("/admin/status", headers=self.admin_headers)
        except httpx.HTTPError as e:
            self.status_error = f"{type(e).__name__}: {e}"
            return None
        if r.status_code != 200:
            self.status_error = f"/admin/status: HTTP {r.status_code}"
            return None
        return r.json()

    async def attach(self) -> None:
        st = await self.status()
        if st is None:
            return
        self.budget = st.get("budget_bytes")
        pid = ((st.get("memory") or {}).get("process") or {}).get("pid")
        if pid:
            import psutil

            with contextlib.suppress(psutil.Error):
                self.proc = psutil.Process(pid)

    async def sample(self, metrics: bool = False) -> MemSample:
        st = await self.status() or {}
        used = st.get("used_bytes") or {}
        cache = st.get("prefix_cache") or {}
        s = MemSample(
            time.monotonic(),
            None,
            used.get("measured"),
            used.get("modelled"),
            cache.get("bytes"),
            cache.get("capacity"),
            None,
            None,
        )
        if self.proc is not None:
            import psutil

            with contextlib.suppress(psutil.Error):
                s.rss = self.proc.memory_info().rss
                s.threads = self.proc.num_threads()
                s.fds = self.proc.num_fds()
        if metrics:
            with contextlib.suppress(httpx.HTTPError):
                text = (await self.http.get("/metrics")).text
                s.metric_series = sum(
                    1 for line in text.splitlines() if line and not line.startswith("#")
                )
        return s


# --- load -------------------------------------------------------------------------------------


@dataclass
class Template:
    name: str
    path: str
    body: dict[str, Any]
    greedy: bool = True


def load_templates(model: str, max_tokens: int) -> list[Template]:
    out = []
    for i, p in enumerate(COMPLETION_PROMPTS):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0}
        out.append(Template(f"completion-{i}", "/v1/completions", body))
    for i, p in enumerate(CHAT_PROMPTS):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": p}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        out.append(Template(f"chat-{i}", "/v1/chat/completions", body))
    # Sampled requests ride along: complete, but their text is not compared.
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
    out.append(
        Template("sampled-0", "/v1/completions", out[0].body | sampled, greedy=False),
    )
    return out


def _stream_body(t: Template, draft: str) -> dict[str, Any]:
    return t.body | {
        "draft": draft,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    mismatched: int = 0
    checked: int = 0  # ok answers compared with their reference
    bad_error_bodies: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    tokens: int = 0
    per_draft: dict[str, int] = field(default_factory=dict)

    def add(self, o: Outcome, label: str, expected: str | None = None) -> None:
        self.outcomes[o.status] = self.outcomes.get(o.status, 0) + 1
        if not o.error_shaped:
            self.bad_error_bodies += 1
            self._sample(label, o, "error body not OpenAI-shaped (or 429 without Retry-After)")
        if o.status == "ok":
            self.latency.append(o.latency_s)
            if o.ttft_s is not None:
                self.ttft.append(o.ttft_s)
            self.tokens += o.tokens
            if expected is not None:
                self.checked += 1
            if expected is not None and o.text != expected:
                self.mismatched += 1
                self._sample(label, o, f"text differs from the reference {expected!r}")
        elif o.status != "rejected":
            self._sample(label, o, o.error or o.status)

    def _sample(self, label: str, o: Outcome, why: str) -> None:
        if len(self.samples) < 20:
            self.samples.append({"request": label, "why": why, "got": o.text[:200]} | _brief(o))

    def count(self, *names: str) -> int:
        return sum(self.outcomes.get(n, 0) for n in names)


def _brief(o: Outcome) -> dict[str, Any]:
    return {"status": o.status, "http_status": o.http_status, "error": o.error}


async def _served_model(http: httpx.AsyncClient) -> str:
    r = await http.get("/v1/models")
    if r.status_code != 200:
        raise SystemExit(f"/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    return str(r.json()["data"][0]["id"])


def _memory_report(samples: list[MemSample], budget: int | None) -> dict[str, Any]:
    def peak(attr: str) -> int | None:
        vals = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return max(vals) if vals else None

    rss, measured = peak("rss"), peak("measured")
    worst = max((v for v in (rss, measured) if v is not None), default=None)
    return {
        "budget_bytes": budget,
        "samples": len(samples),
        "peak_rss_bytes": rss,
        "peak_measured_bytes": measured,
        "peak_modelled_bytes": peak("modelled"),
        "peak_prefix_cache_bytes": peak("prefix_cache"),
        "within_budget": None if budget is None or worst is None else worst <= budget,
        "peak": format_size(worst) if worst is not None else None,
    }


async def run_load(
    url: str,
    *,
    api_key: str | None = None,
    admin_key: str | None = None,
    clients: int = 32,
    seconds: float = 120.0,
    max_tokens: int = 16,
    drafts: list[str] | None = None,
    request_timeout: float = 180.0,
    backoff_cap_s: float = 2.0,
    seed: int = 0,
) -> dict[str, Any]:
    """N streaming clients for `seconds`; see the module docstring for what is checked."""
    drafts = drafts or DRAFTS
    rng = random.Random(seed)
    async with async_client(url, api_key, request_timeout, clients + 4) as http:
        daemon = Daemon(http, bearer(admin_key or api_key))
        await daemon.attach()
        model = await _served_model(http)
        templates = load_templates(model, max_tokens)

        # 1. Each greedy request alone, one at a time, plain target decoding: the reference.
        reference: dict[str, str] = {}
        t_ref = time.perf_counter()
        for t in templates:
            if t.greedy:
                o = await _bounded(_request(http, t.path, _stream_body(t, "none")), request_timeout)
                if o.status != "ok":
                    raise SystemExit(f"reference run of {t.name} failed: {o.error or o.status}")
                reference[t.name] = o.text
        ref_s = time.perf_counter() - t_ref

        # 2. The load: every client loops until the deadline; 429s back off and retry.
        tally = Tally()
        samples: list[MemSample] = [await daemon.sample()]
        retry_after: list[float] = []
        deadline = time.monotonic() + seconds
        started = 0

        async def client(c: int) -> None:
            nonlocal started
            i = c
            while time.monotonic() < deadline:
                t = templates[i % len(templates)]
                draft = drafts[(i // len(templates) + c) % len(drafts)]
                i += 1
                started += 1
                o = await _bounded(_request(http, t.path, _stream_body(t, draft)), request_timeout)
                label = f"{t.name} draft={draft}"
                tally.add(o, label, reference.get(t.name) if t.greedy else None)
                if o.status == "ok":
                    tally.per_draft[draft] = tally.per_draft.get(draft, 0) + 1
                elif o.status == "rejected":
                    if o.retry_after_s is not None:
                        retry_after.append(o.retry_after_s)
                    # Honour Retry-After, capped so the queue stays full (that is the test).
                    wait = min(o.retry_after_s or 1.0, backoff_cap_s)
                    await asyncio.sleep(wait * rng.uniform(0.5, 1.0))

        async def sampler() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(2.0)
                samples.append(await daemon.sample())

        t0 = time.perf_counter()
        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        samples.append(await daemon.sample())
        health = (await http.get("/health")).status_code

    answered = tally.count("ok", "rejected", "client_error", "server_error")
    lost = tally.count("transport", "timeout", "incomplete")
    memory = _memory_report(samples, daemon.budget)
    checks = {
        "no_5xx": tally.count("server_error") == 0,
        "no_hangs": tally.count("timeout") == 0,
        "none_lost": lost == 0,
        "none_corrupted": tally.mismatched == 0,
        "no_other_4xx": tally.count("client_error") == 0,
        "errors_openai_shaped": tally.bad_error_bodies == 0,
        "served_some": tally.count("ok") > 0,
        "memory_within_budget": memory["within_budget"] is not False,
        "healthy_after": health == 200,
    }
    return {
        "kind": "load",
        "url": url,
        "model": model,
        "clients": clients,
        "seconds": seconds,
        "max_tokens": max_tokens,
        "drafts": drafts,
        "templates": [t.name for t in templates],
        "reference_s": round(ref_s, 2),
        "wall_s": round(wall, 2),
        "requests": started,
        "answered": answered,
        "ok": tally.count("ok"),
        "rejected_429": tally.count("rejected"),
        "retry_after_s": dist(retry_after),
        "client_errors_4xx": tally.count("client_error"),
        "server_errors_5xx": tally.count("server_error"),
        "hung": tally.count("timeout"),
        "lost": lost,
        "corrupted": tally.mismatched,
        "greedy_checked": tally.checked,
        "ok_per_draft": tally.per_draft,
        "tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / wall, 2) if wall > 0 else None,
        "ttft_s": dist(tally.ttft),
        "latency_s": dist(tally.latency),
        "memory": memory,
        "status_error": daemon.status_error,
        "failures": tally.samples,
        "checks": checks,
        "passed": all(checks.values()),
    }


# --- soak -------------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, Any]] = [
    ("/v1/completions", b'{"model": "m", "prompt": '),  # truncated JSON
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}),  # past int32 (below: capped)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "draft": "../x"}),
    ("/v1/chat/completions", {"messages": "not a list"}),
]


class Memo:
    """Greedy answers by request (draft excluded: every draft must give the same text)."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}
        self.checked = 0

    @staticmethod
    def key(path: str, body: dict[str, Any]) -> str:
        stable = {k: v for k, v in body.items() if k not in ("draft", "stream", "stream_options")}
        return hashlib.sha256(f"{path} {json.dumps(stable, sort_keys=True)}".encode()).hexdigest()

    def expected(self, key: str) -> str | None:
        return self.first.get(key)

    def record(self, key: str, text: str) -> None:
        self.first.setdefault(key, text)


def _growth_report(
    start: MemSample, end: MemSample, max_growth: int, budget: int | None
) -> dict[str, Any]:
    def delta(attr: str) -> int | None:
        a, b = getattr(start, attr), getattr(end, attr)
        return None if a is None or b is None else b - a

    rss_delta = delta("rss") if start.rss is not None else delta("measured")
    cache_delta = max(0, delta("prefix_cache") or 0)
    unexplained = None if rss_delta is None else rss_delta - cache_delta
    cap = end.prefix_cache_capacity
    return {
        "start": asdict(start),
        "end": asdict(end),
        "rss_growth_bytes": rss_delta,
        "prefix_cache_growth_bytes": cache_delta,
        "unexplained_growth_bytes": unexplained,
        "max_growth_bytes": max_growth,
        "bound": f"RSS growth - prefix cache growth <= {format_size(max_growth)}; prefix cache "
        "<= its capacity; threads +2, fds +8, metric series +64 at most",
        "checks": {
            "growth_within_bound": unexplained is not None and unexplained <= max_growth,
            "prefix_cache_within_capacity": cap is None or (end.prefix_cache or 0) <= cap,
            "threads_flat": (delta("threads") or 0) <= 2,
            "fds_flat": (delta("fds") or 0) <= 8,
            "metric_series_flat": (delta("metric_series") or 0) <= 64,
        },
    }


async def run_soak(
    url: str,
    *,
    api_key: str | None = None,
    admin_key: str | None = None,
    minutes: float = 30.0,
    clients: int = 4,
    max_tokens: int = 24,
    warmup_s: float | None = None,
    max_growth: int = 64 << 20,
    sample_every_s: float = 5.0,
    request_timeout: float = 180.0,
    seed: int = 0,
) -> dict[str, Any]:
    """A mixed workload for `minutes`; memory sampled throughout (see the module docstring)."""
    seconds = minutes * 60.0
    warmup = warmup_s if warmup_s is not None else min(300.0, max(15.0, seconds * 0.1))
    async with async_client(url, api_key, request_timeout, clients + 4) as http:
        daemon = Daemon(http, bearer(admin_key or api_key))
        await daemon.attach()
        model = await _served_model(http)
        templates = [t for t in load_templates(model, max_tokens) if t.greedy]
        memo = Memo()
        tally = Tally()
        counts: dict[str, int] = {}
        bad_answers: list[int] = []
        t_start = time.monotonic()
        deadline = t_start + seconds
        samples: list[MemSample] = [await daemon.sample(metrics=True)]

        async def greedy(path: str, body: dict[str, Any], label: str) -> Outcome:
            key = Memo.key(path, body)
            o = await _bounded(_request(http, path, body), request_timeout)
            tally.add(o, label, memo.expected(key))
            if o.status == "ok":
                if memo.expected(key) is not None:
                    memo.checked += 1
                memo.record(key, o.text)
            return o

        async def session(rng: random.Random) -> None:
            j = rng.randrange(len(CHAT_PROMPTS))
            messages = [{"role": "user", "content": CHAT_PROMPTS[j]}]
            for turn in range(1 + rng.randrange(3)):
                body = {
                    "model": model,
                    "messages": list(messages),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "draft": rng.choice(DRAFTS),
                    "stream": rng.random() < 0.7,
                }
                o = await greedy("/v1/chat/completions", body, f"session chat-{j} turn {turn}")
                if o.status != "ok":
                    return
                messages += [
                    {"role": "assistant", "content": o.text},
                    {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
                ]

        async def completion(rng: random.Random) -> None:
            t = rng.choice(templates)
            body = t.body | {"draft": rng.choice(DRAFTS), "stream": rng.random() < 0.5}
            await greedy(t.path, body, t.name)

        async def disconnect(rng: random.Random) -> None:
            t = rng.choice(templates)
            body = _stream_body(t, rng.choice(DRAFTS)) | {"max_tokens": max_tokens * 4}
            with contextlib.suppress(httpx.HTTPError):
                async with http.stream("POST", t.path, json=body) as resp:
                    if resp.status_code == 200:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: "):
                                break  # hang up after the first event

        async def bad(rng: random.Random) -> None:
            path, body = rng.choice(BAD_REQUESTS)
            try:
                if isinstance(body, bytes):
                    r = await http.post(
                        path, content=body, headers={"Content-Type": "application/json"}
                    )
                else:
                    r = await http.post(path, json={"model": model} | body)
            except httpx.HTTPError:
                bad_answers.append(0)
                return
            try:
                shaped = openai_error_shaped(r.json())
            except ValueError:  # not JSON at all: counted as a malformed answer
                shaped = False
            bad_answers.append(r.status_code if shaped else -r.status_code)

        async def admin(rng: random.Random) -> None:
            await daemon.status()
            with contextlib.suppress(httpx.HTTPError):
                await http.get("/metrics")

        # A fixed cycle (4 sessions, 3 completions, a hang-up, a malformed request, a scrape),
        # each client starting elsewhere in it, so even a short run has the whole mix.
        cycle = [session, completion, disconnect, session, bad]
        cycle += [completion, session, admin, completion, session]

        async def client(c: int) -> None:
            rng = random.Random(seed * 1000 + c)
            i = 3 * c
            while time.monotonic() < deadline:
                action = cycle[i % len(cycle)]
                i += 1
                counts[action.__name__] = counts.get(action.__name__, 0) + 1
                await action(rng)

        async def sampler() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(sample_every_s)
                samples.append(await daemon.sample(metrics=True))

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(client(c) for c in range(clients)))
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        await asyncio.sleep(1.0)  # let the engine finish what the last hang-ups left
        end = await daemon.sample(metrics=True)
        samples.append(end)
        health = (await http.get("/health")).status_code

    after_warmup = [s for s in samples if s.t >= t_start + warmup]
    start = after_warmup[0] if after_warmup else samples[0]
    growth = _growth_report(start, end, max_growth, daemon.budget)
    memory = _memory_report(samples, daemon.budget)
    lost = tally.count("transport", "timeout", "incomplete")
    checks = {
        "no_5xx": tally.count("server_error") == 0,
        "no_hangs": tally.count("timeout") == 0,
        "none_lost": lost == 0,
        "none_corrupted": tally.mismatched == 0,
        "errors_openai_shaped": tally.bad_error_bodies == 0,
        "malformed_requests_4xx": all(400 <= c < 500 for c in bad_answers),
        "served_some": tally.count("ok") > 0,
        "memory_within_budget": memory["within_budget"] is not False,
        "healthy_after": health == 200,
        **growth["checks"],
    }
    return {
        "kind": "soak",
        "url": url,
        "model": model,
        "minutes": minutes,
        "clients": clients,
        "max_tokens": max_tokens,
        "warmup_s": warmup,
        "actions": counts,
        "ok": tally.count("ok"),
        "rejected_429": tally.count("rejected"),
        "client_errors_4xx": tally.count("client_error"),
        "server_errors_5xx": tally.count("server_error"),
        "hung": tally.count("timeout"),
        "lost": lost,
        "corrupted": tally.mismatched,
        "repeats_checked": memo.checked,
        "distinct_greedy_requests": len(memo.first),
        "malformed_answers": sorted(set(bad_answers)),
        "tokens": tally.tokens,
        "ttft_s": dist(tally.ttft),
        "latency_s": dist(tally.latency),
        "memory": memory,
        "growth": growth,
        "series": [
            {"t": round(s.t - t_start, 1), "rss": s.rss, "prefix_cache": s.prefix_cache}
            for s in samples[:: max(1, len(samples) // 200)]
        ],
        "failures": tally.samples,
        "checks": checks,
        "passed": all(checks.values()),
    }


# --- command line -----------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    from memspec.config import client_env

    env = client_env("http://127.0.0.1:8000")
    p.add_argument("--url", default=env["url"])
    p.add_argument("--api-key", default=env["api_key"], help="key for /v1")
    p.add_argument(
        "--admin-key",
        default=env["admin_key"],
        help="key for /admin/status (memory samples; default: the API key)",
    )
    p.add_argument("--out", help="write the JSON report here (else to stdout)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=180.0, help="a longer answer is a hang")
    p.add_argument("--seed", type=int, default=0)


def register_bench(bsub: Any) -> None:
    """`memspec bench load` and `memspec bench soak` (called from memspec.cli)."""
    lo = bsub.add_parser("load", help="N streaming clients for a bounded time (loopback)")
    _common(lo)
    lo.add_argument("--clients", type=int, default=32)
    lo.add_argument("--seconds", type=float, default=120.0)
    lo.add_argument("--drafts", default=",".join(DRAFTS), help="comma-separated `draft` values")
    lo.set_defaults(func=cmd_load)
    so = bsub.add_parser("soak", help="mixed requests for a long time; memory start vs end")
    _common(so)
    so.add_argument("--minutes", type=float, default=30.0)
    so.add_argument("--clients", type=int, default=4)
    so.add_argument("--warmup-s", type=float, default=None, help="default 10%%, 15-300 s")
    so.add_argument("--max-growth", default="64MiB", help="allowed growth after the warm-up")
    so.set_defaults(func=cmd_soak)


def _check_url(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if not is_loopback(host):
        raise SystemExit(f"load and soak run only against a loopback daemon, not {host!r}")
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=5)
    except httpx.HTTPError as e:
        raise SystemExit(
            f"no daemon answers at {url} ({type(e).__name__}): start one with `memspec serve`"
            " or name it with --url"
        ) from None


def _finish(rep: dict[str, Any], out: str | None) -> int:
    text = json.dumps(rep, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    else:
        print(text)
    failed = [k for k, ok in rep["checks"].items() if not ok]
    summary = (
        f"{rep['kind']}: ok {rep['ok']}, 429 {rep['rejected_429']}, 5xx "
        f"{rep['server_errors_5xx']}, lost {rep['lost']}, corrupted {rep['corrupted']}, "
        f"peak memory {rep['memory']['peak']} of budget "
        f"{format_size(rep['memory']['budget_bytes'] or 0)}"
    )
    print(summary + ("" if not failed else f"; FAILED: {', '.join(failed)}"), file=sys.stderr)
    return 0 if rep["passed"] else 1


def cmd_load(args: argparse.Namespace) -> int:
    _check_url(args.url)
    rep = asyncio.run(
        run_load(
            args.url,
            api_key=args.api_key,
            admin_key=args.admin_key,
            clients=args.clients,
            seconds=args.seconds,
            max_tokens=args.max_tokens or 16,
            drafts=[d for d in args.drafts.split(",") if d],
            request_timeout=args.request_timeout,
            seed=args.seed,
        )
    )
    return _finish(rep, args.out)


def cmd_soak(args: argparse.Namespace) -> int:
    _check_url(args.url)
    rep = asyncio.run(
        run_soak(
            args.url,
            api_key=args.api_key,
            admin_key=args.admin_key,
            minutes=args.minutes,
            clients=args.clients,
            max_tokens=args.max_tokens or 24,
            warmup_s=args.warmup_s,
            max_growth=parse_size(args.max_growth),
            request_timeout=args.request_timeout,
            seed=args.seed,
        )
    )
    return _finish(rep, args.out)


def main(argv: list[str] | None = None) -> int:
    """`python -m memspec_lab.bench.load load|soak ...` (the same as `memspec bench load|soak`)."""
    p = argparse.ArgumentParser(prog="memspec bench", description=__doc__.split("\n")[0])
    register_bench(p.add_subparsers(dest="action", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
