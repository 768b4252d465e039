"""The HTTP client to a MemSpec daemon: the admin API for `memspec-ctl`, and the one streaming
completion reader shared by both load generators (`memspec-ctl bench`, `memspec bench load|soak`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

EXIT_OK = 0
EXIT_SERVER = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4


class CtlError(Exception):
    """A failure to report as one line with an exit status."""

    def __init__(self, message: str, code: int = EXIT_SERVER) -> None:
        super().__init__(message)
        self.message = one_line(message)
        self.code = code


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _error_message(resp: httpx.Response) -> str:
    """The server's reason: OpenAI-shaped error.message, FastAPI's detail, or the body."""
    try:
        body = resp.json()
    except ValueError:
        return one_line(resp.text or resp.reason_phrase, 200)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return one_line(err["message"], 200)
        if isinstance(err, str):
            return one_line(err, 200)
        detail = body.get("detail")
        if detail is not None:
            return one_line(detail if isinstance(detail, str) else json.dumps(detail), 200)
    return one_line(resp.text, 200)


def _transport_error(url: str, e: httpx.HTTPError, timeout: float) -> CtlError:
    if isinstance(e, httpx.TimeoutException):
        return CtlError(f"no answer from {url} within {timeout:g}s", EXIT_UNREACHABLE)
    reason = str(e) or type(e).__name__
    # The async transport says "All connection attempts failed"; the cause says why.
    causes, c = [], e.__cause__ or e.__context__
    while c is not None and len(causes) < 5:
        causes.append(c)
        c = c.__cause__ or c.__context__
    refused = any(isinstance(c, ConnectionRefusedError) for c in causes)
    if refused or "refused" in reason.lower():
        reason = "connection refused (is `memspec serve` running?)"
    return CtlError(f"cannot connect to {url}: {reason}", EXIT_UNREACHABLE)


class Client:
    """The admin API over httpx, every failure turned into a CtlError."""

    def __init__(self, url: str, key: str | None = None, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.key = key or None
        self.timeout = timeout
        self.http = httpx.Client(base_url=self.url, headers=bearer(self.key), timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("POST", path, body)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict:
        try:
            resp = self.http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise _transport_error(self.url, e, self.timeout) from None
        if resp.status_code in (401, 403):
            hint = (
                "the daemon refused this client's Host or Origin (see allowed_hosts)"
                if resp.status_code == 403
                else "the admin key was rejected"
                if self.key
                else "the daemon needs an admin key: pass --key or set MEMSPEC_ADMIN_KEY"
            )
            raise CtlError(
                f"unauthorized (HTTP {resp.status_code}): {_error_message(resp)}; {hint}",
                EXIT_AUTH,
            )
        if resp.status_code >= 400:
            raise CtlError(f"{_error_message(resp)} (HTTP {resp.status_code} on {method} {path})")
        try:
            data = resp.json()
        except ValueError:
            raise CtlError(
                f"{method} {path}: not a JSON answer; is {self.url} a MemSpec daemon?"
            ) from None
        if not isinstance(data, dict):
            raise CtlError(f"{method} {path}: unexpected answer {one_line(resp.text, 80)}")
        if data.get("ok") is False:
            raise CtlError(f"{method} {path}: {data.get('error') or 'refused by the daemon'}")
        return data


# --- streamed completions (both load generators) -----------------------------------------


def async_client(url: str, key: str | None, timeout: float, connections: int) -> httpx.AsyncClient:
    """The /v1 client of a load generator: one pooled connection per concurrent request."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, headers=bearer(key), timeout=timeout, limits=limits)


def delta_text(obj: dict[str, Any]) -> tuple[str, str | None]:
    """The text and finish_reason of a completion, chat completion, or either's stream event."""
    text, finish = "", None
    for c in obj.get("choices") or []:
        if "delta" in c:
            text += (c.get("delta") or {}).get("content") or ""
        elif "message" in c:
            text += (c.get("message") or {}).get("content") or ""
        else:
            text += c.get("text") or ""
        finish = c.get("finish_reason") or finish
    return text, finish


@dataclass
class Streamed:
    """What one streamed completion sent back, and how its stream ended."""

    text: str = ""
    finish_reason: str | None = None
    text_events: int = 0  # events that carried text: the token count when usage is missing
    usage_tokens: int | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens, when the server sent usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (reused KV)
    ttft_s: float | None = None  # at the first event carrying text
    latency_s: float = 0.0
    done: bool = False  # ended with `data: [DONE]`
    error: Any = None  # an error event mid-stream (the whole event): reading stopped there


async def stream_completion(
    http: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, Streamed | None]:
    """POST a streaming request and read its SSE events. A non-200 answer comes back read
    whole (resp.content) with None, for the caller to classify. Raises httpx.HTTPError, and
    ValueError on an event that is not a JSON object."""
    t0 = time.perf_counter()
    async with http.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp, None
        out = Streamed()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                break
            event = json.loads(data)
            if not isinstance(event, dict):
                raise ValueError(f"stream event is not a JSON object: {data[:80]}")
            if "error" in event:
                out.error = event
                break
            text, finish = delta_text(event)
            if text:
                out.text_events += 1
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - t0
            out.text += text
            out.finish_reason = finish or out.finish_reason
            usage = event.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                out.usage_tokens = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    out.prompt_tokens = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
        out.latency_s = time.perf_counter() - t0
        return resp, out


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def dist(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
    }


# --- memspec-ctl bench -------------------------------------------------------------------


async def _one_request(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: TTFT at the first chunk carrying text, tokens from usage."""
    t0 = time.perf_counter()
    try:
        resp, s = await stream_completion(http, "/v1/completions", body)
    except httpx.TimeoutException:
        return {"status": "error", "error": "timed out"}
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        return {"status": "error", "error": one_line(f"{type(e).__name__}: {e}", 200)}
    if s is None:
        return {
            "status": "rejected" if resp.status_code == 429 else "error",
            "http_status": resp.status_code,
            "error": f"HTTP {resp.status_code}: {_error_message(resp)}",
            "latency_s": time.perf_counter() - t0,
        }
    if s.error is not None:
        err = s.error["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        return {"status": "error", "error": one_line(f"in stream: {msg}", 200)}
    latency, ttft = s.latency_s, s.ttft_s
    tokens = s.usage_tokens if s.usage_tokens is not None else s.text_events
    decode = (
        (tokens - 1) / (latency - ttft)
        if ttft is not None and tokens > 1 and latency > ttft
        else None
    )
    return {
        "status": "ok",
        "ttft_s": ttft,
        "latency_s": latency,
        "tokens": tokens,
        "tokens_per_s": tokens / latency if latency > 0 else None,
        "decode_tokens_per_s": decode,
    }


async def _served_model(http: httpx.AsyncClient, url: str, timeout: float) -> str:
    try:
        resp = await http.get("/v1/models")
    except httpx.HTTPError as e:
        raise _transport_error(url, e, timeout) from None
    if resp.status_code in (401, 403):
        raise CtlError(
            f"unauthorized (HTTP {resp.status_code}) on /v1/models: {_error_message(resp)}; "
            "pass --api-key or set MEMSPEC_API_KEY",
            EXIT_AUTH,
        )
    if resp.status_code == 503:
        raise CtlError(f"{url} is not ready yet (HTTP 503)", EXIT_UNREACHABLE)
    if resp.status_code != 200:
        raise CtlError(f"/v1/models: {_error_message(resp)} (HTTP {resp.status_code})")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise CtlError("/v1/models lists no model; pass --model") from None


async def run_bench(
    url: str,
    key: str | None,
    *,
    requests: int,
    concurrency: int,
    max_tokens: int,
    prompts: list[str],
    time_limit: float,
    timeout: float,
    model: str | None = None,
    draft: str | None = None,
) -> dict[str, Any]:
    async with async_client(url, key, timeout, concurrency) as http:
        model = model or await _served_model(http, url, timeout)
        sem = asyncio.Semaphore(concurrency)
        results: list[dict[str, Any]] = []

        async def worker(i: int) -> None:
            body: dict[str, Any] = {
                "model": model,
                "prompt": prompts[i % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if draft:
                body["draft"] = draft
            async with sem:
                res = await _one_request(http, body)
            res["index"] = i
            results.append(res)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(i)) for i in range(requests)]
        _, pending = await asyncio.wait(tasks, timeout=time_limit)
        for t in pending:  # past the time limit: cut what is left, count it as unfinished
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0

    ok = [r for r in results if r["status"] == "ok"]
    errors = [r for r in results if r["status"] == "error"]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "url": url,
        "model": model,
        "requests": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "ok": len(ok),
        "rejected_429": sum(1 for r in results if r["status"] == "rejected"),
        "errors": len(errors),
        "unfinished": requests - len(results),
        "error_samples": sorted({r["error"] for r in errors})[:3],
        "wall_s": wall,
        "tokens": tokens,
        "throughput_tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_s": dist([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "latency_s": dist([r["latency_s"] for r in ok]),
        "tokens_per_s": dist([r["tokens_per_s"] for r in ok if r["tokens_per_s"] is not None]),
        "per_request": sorted(results, key=lambda r: r["index"]),
    }
