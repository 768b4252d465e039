"""`memspec-ctl`: inspect and steer a running MemSpec daemon through its admin API.

    memspec-ctl [--url URL] [--key KEY] [--timeout S] COMMAND
      status [--json]                        budget, used bytes, policy, target, drafts, tok/s
      drafts list [--json]                   the draft pool and what is resident
      drafts load|evict|pin|unpin ID [--json]
      tune budget SIZE | policy NAME | k-max N | n-ctx N [--json]   applied live, persisted
      watch [--interval S] [--count N]       live status view (Ctrl-C to quit)
      bench [--requests N] [--concurrency C] [--max-tokens M] [--prompt P ...] [--json]

--url defaults to $MEMSPEC_URL or http://127.0.0.1:8000, --key to $MEMSPEC_ADMIN_KEY (sent as
`Authorization: Bearer KEY` to /admin). bench talks to /v1 with --api-key ($MEMSPEC_API_KEY),
else the admin key.

Exit status: 0 ok; 1 the daemon answered with an error (unknown draft, bad setting, 5xx) or
bench requests failed; 2 usage error, nothing sent (bad argument, bad size, bad URL);
3 daemon unreachable (refused, timed out, not ready); 4 unauthorized (401/403).
Every failure is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

import httpx

from memspec.net import is_loopback
from memspec.units import format_size, parse_size

EXIT_OK = 0
EXIT_SERVER = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4

DEFAULT_URL = "http://127.0.0.1:8000"
# A plain continuation: an instruct model given a question as a raw completion prompt often
# stops at once, which would measure nothing.
DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived"

# bench is a load generator on a small device: keep it bounded so a typo cannot turn it into
# a denial of service of the daemon (or of someone else's, hence loopback only).
BENCH_MAX_REQUESTS = 1000
BENCH_MAX_CONCURRENCY = 64
BENCH_MAX_TOKENS = 4096
BENCH_MAX_TIME_S = 600.0


class CtlError(Exception):
    """A failure to report as one line with an exit status."""

    def __init__(self, message: str, code: int = EXIT_SERVER) -> None:
        super().__init__(message)
        self.message = _one_line(message)
        self.code = code


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- HTTP --------------------------------------------------------------------------------


def _error_message(resp: httpx.Response) -> str:
    """The server's reason: OpenAI-shaped error.message, FastAPI's detail, or the body."""
    try:
        body = resp.json()
    except ValueError:
        return _one_line(resp.text or resp.reason_phrase, 200)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(err["message"], 200)
        if isinstance(err, str):
            return _one_line(err, 200)
        detail = body.get("detail")
        if detail is not None:
            return _one_line(detail if isinstance(detail, str) else json.dumps(detail), 200)
    return _one_line(resp.text, 200)


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
        self.headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

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
                "the admin key was rejected"
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
            raise CtlError(f"{method} {path}: unexpected answer {_one_line(resp.text, 80)}")
        if data.get("ok") is False:
            raise CtlError(f"{method} {path}: {data.get('error') or 'refused by the daemon'}")
        return data


# --- formatting --------------------------------------------------------------------------


def _size(n: Any) -> str:
    return format_size(int(n)) if isinstance(n, int | float) else "-"


def _pct(part: Any, whole: Any) -> str:
    if isinstance(part, int | float) and isinstance(whole, int | float) and whole > 0:
        return f" ({100 * part / whole:.0f}%)"
    return ""


def _yes(v: Any) -> str:
    return "-" if v is None else ("yes" if v else "no")


def _num(v: Any, fmt: str = ".2f") -> str:
    return format(v, fmt) if isinstance(v, int | float) and not isinstance(v, bool) else "-"


def _duration(s: Any) -> str:
    if not isinstance(s, int | float):
        return "-"
    s = int(s)
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """Aligned columns; indexes in `right` are right-aligned (numbers)."""
    right = right or set()
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def kv_table(pairs: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in pairs)


def drafts_table(drafts: list[dict[str, Any]]) -> str:
    if not drafts:
        return "(no drafts)"
    rows = [
        [
            str(d.get("id", "?")),
            str(d.get("kind", "-")),
            _size(d.get("bytes")),
            _yes(d.get("resident")),
            _yes(d.get("pinned")),
            _num(d.get("acceptance")),
            _num(d.get("requests"), "d"),
        ]
        for d in drafts
    ]
    headers = ["DRAFT", "KIND", "SIZE", "RESIDENT", "PINNED", "ACCEPT", "REQUESTS"]
    return table(headers, rows, right={2, 5, 6})


def _memory_lines(mem: Any) -> list[tuple[str, str]]:
    """What the telemetry snapshot says, when the daemon includes it (tolerant of shape)."""
    if not isinstance(mem, dict):
        return []
    out = []
    system = mem.get("system") or {}
    if system.get("available_bytes") is not None:
        out.append(
            (
                "system",
                f"{_size(system['available_bytes'])} available of "
                f"{_size(system.get('total_bytes'))}",
            )
        )
    proc = mem.get("process") or {}
    if proc.get("rss_bytes") is not None:
        uss = f", USS {_size(proc['uss_bytes'])}" if proc.get("uss_bytes") is not None else ""
        out.append(("process", f"RSS {_size(proc['rss_bytes'])}{uss}"))
    jetson = mem.get("jetson")
    if isinstance(jetson, dict):
        jp = f", JetPack {jetson['jetpack']}" if jetson.get("jetpack") else ""
        model = f", {jetson['model']}" if jetson.get("model") else ""
        out.append(("jetson", f"L4T {jetson.get('l4t', '?')}{jp}{model}"))
    if mem.get("nvmap_used_bytes") is not None:
        out.append(("nvmap", f"{_size(mem['nvmap_used_bytes'])} used (GPU, shared DRAM)"))
    cuda = mem.get("cuda")
    if isinstance(cuda, dict) and cuda.get("total_bytes"):
        out.append(
            ("cuda", f"{_size(cuda.get('free_bytes'))} free of {_size(cuda['total_bytes'])}")
        )
    return out


def render_status(st: dict[str, Any], url: str, prev: dict[str, Any] | None = None) -> str:
    budget = st.get("budget_bytes")
    used = st.get("used_bytes") or {}
    if not isinstance(used, dict):  # a plain number: treat it as measured
        used = {"measured": used}
    queue = st.get("queue") or {}
    served = st.get("requests_served")
    delta = ""
    if (
        prev is not None
        and isinstance(served, int)
        and isinstance(prev.get("requests_served"), int)
    ):
        delta = f" (+{served - prev['requests_served']})"
    backend = f" ({st['backend']})" if st.get("backend") else ""
    pairs = [
        (
            "daemon",
            f"{url}  {st['state'] + ', ' if st.get('state') else ''}"
            f"version {st.get('version', '?')}, up {_duration(st.get('uptime_s'))}",
        ),
        ("target", f"{st.get('model', '-')}{backend}"),
        ("policy", f"{st.get('policy', '-')}   k_max {st.get('k_max', '-')}"),
        ("n_ctx", str(st.get("n_ctx", "-"))),
        ("budget", _size(budget)),
        (
            "used",
            f"measured {_size(used.get('measured'))}{_pct(used.get('measured'), budget)}   "
            f"modelled {_size(used.get('modelled'))}{_pct(used.get('modelled'), budget)}",
        ),
        *_memory_lines(st.get("memory")),
        ("queue", f"{queue.get('depth', '-')} / {queue.get('max', '-')}"),
        ("requests", f"{served if served is not None else '-'}{delta}"),
        ("tok/s", f"{_num(st.get('tokens_per_s_recent'), '.1f')} (recent)"),
    ]
    return kv_table(pairs) + "\n\n" + drafts_table(st.get("drafts") or [])


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


# --- commands ----------------------------------------------------------------------------


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    st = client.get("/admin/status")
    if args.json:
        _print_json(st)
    else:
        print(render_status(st, client.url))
    return EXIT_OK


def cmd_drafts(client: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        data = client.get("/admin/drafts")
        if args.json:
            _print_json(data)
        else:
            print(drafts_table(data.get("drafts") or []))
        return EXIT_OK
    data = client.post(f"/admin/drafts/{quote(args.id, safe='')}/{args.action}")
    if args.json:
        _print_json(data)
        return EXIT_OK
    d = data.get("draft") or {"id": args.id}
    done = {"load": "loaded", "evict": "evicted", "pin": "pinned", "unpin": "unpinned"}
    print(
        f"{done[args.action]} {d.get('id', args.id)}: {_size(d.get('bytes'))}, "
        f"resident {_yes(d.get('resident'))}, pinned {_yes(d.get('pinned'))}"
    )
    return EXIT_OK


def cmd_tune(client: Client, args: argparse.Namespace) -> int:
    data = client.post("/admin/tune", {args.field: args.value})
    settings = data.get("settings") or {}
    if args.json:
        _print_json(data)
        return EXIT_OK
    pairs = []
    for k, v in settings.items():
        shown = f"{_size(v)} ({v})" if k in ("budget", "budget_bytes") and isinstance(v, int) else v
        pairs.append((k, str(shown)))
    print(f"set {args.field} = {args.value}")
    if pairs:
        print(kv_table(pairs))
    return EXIT_OK


def cmd_watch(client: Client, args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    prev: dict[str, Any] | None = None
    rc = EXIT_OK
    n = 0
    try:
        while True:
            stamp = time.strftime("%H:%M:%S")
            try:
                st = client.get("/admin/status")
                body, rc = render_status(st, client.url, prev), EXIT_OK
                prev = st
            except CtlError as e:
                body, rc = f"(no status: {e.message})", e.code
                print(f"memspec-ctl: error: {e.message}", file=sys.stderr)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
            elif n:
                print()
            print(f"--- {stamp}  every {args.interval:g}s  (Ctrl-C to quit) ---")
            print(body, flush=True)
            n += 1
            if args.count is not None and n >= args.count:
                return rc
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return rc


# --- bench -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
    }


async def _one_request(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: TTFT at the first chunk carrying text, tokens from usage."""
    t0 = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                status = "rejected" if resp.status_code == 429 else "error"
                return {
                    "status": status,
                    "http_status": resp.status_code,
                    "error": f"HTTP {resp.status_code}: {_error_message(resp)}",
                    "latency_s": time.perf_counter() - t0,
                }
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if isinstance(obj, dict) and obj.get("error"):
                    err = obj["error"]
                    msg = err.get("message") if isinstance(err, dict) else err
                    return {"status": "error", "error": _one_line(f"in stream: {msg}", 200)}
                text = "".join((c.get("text") or "") for c in obj.get("choices") or [])
                if text:
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except httpx.TimeoutException:
        return {"status": "error", "error": "timed out"}
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        return {"status": "error", "error": _one_line(f"{type(e).__name__}: {e}", 200)}
    latency = time.perf_counter() - t0
    tokens = usage_tokens if usage_tokens is not None else chunks
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
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as http:
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
        "ttft_s": _dist([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "latency_s": _dist([r["latency_s"] for r in ok]),
        "tokens_per_s": _dist([r["tokens_per_s"] for r in ok if r["tokens_per_s"] is not None]),
        "per_request": sorted(results, key=lambda r: r["index"]),
    }


def render_bench(rep: dict[str, Any]) -> str:
    head = (
        f"bench  {rep['requests']} requests, concurrency {rep['concurrency']}, "
        f"max_tokens {rep['max_tokens']}, model {rep['model']}, {rep['wall_s']:.2f} s\n"
        f"ok {rep['ok']}   429 {rep['rejected_429']}   errors {rep['errors']}   "
        f"unfinished {rep['unfinished']}   tokens {rep['tokens']}   "
        f"throughput {_num(rep['throughput_tokens_per_s'], '.1f')} tok/s"
    )

    def row(name: str, d: dict[str, Any], scale: float, fmt: str) -> list[str]:
        return [name] + [
            _num(d[k] * scale if d[k] is not None else None, fmt)
            for k in ("p50", "p90", "p99", "mean")
        ]

    rows = [
        row("ttft (ms)", rep["ttft_s"], 1e3, ".1f"),
        row("latency (ms)", rep["latency_s"], 1e3, ".1f"),
        row("tok/s per request", rep["tokens_per_s"], 1.0, ".1f"),
    ]
    out = head + "\n\n" + table(["", "P50", "P90", "P99", "MEAN"], rows, right={1, 2, 3, 4})
    for e in rep["error_samples"]:
        out += f"\nerror: {e}"
    if rep["ok"] and not rep["tokens"]:
        out += "\nnote: no tokens generated (the model stopped at once); try another --prompt"
    return out


def cmd_bench(client: Client, args: argparse.Namespace) -> int:
    host = urlsplit(client.url).hostname or ""
    if not is_loopback(host):
        raise CtlError(
            f"bench runs only against a daemon on this machine (loopback), not {host!r}",
            EXIT_USAGE,
        )
    rep = asyncio.run(
        run_bench(
            client.url,
            args.api_key or client.key,
            requests=args.requests,
            concurrency=min(args.concurrency, args.requests),
            max_tokens=args.max_tokens,
            prompts=args.prompt or [DEFAULT_PROMPT],
            time_limit=args.time_limit,
            timeout=client.timeout,
            model=args.model,
            draft=args.draft,
        )
    )
    if args.json:
        _print_json(rep)
    else:
        print(render_bench(rep))
    failed = rep["errors"] + rep["unfinished"]
    if failed or rep["ok"] == 0:
        why = rep["error_samples"][0] if rep["error_samples"] else None
        if rep["unfinished"]:
            why = f"time limit {args.time_limit:g}s reached"
        elif why is None and rep["rejected_429"]:
            why = "every request was rejected with 429 (queue full)"
        raise CtlError(f"bench: {failed or rep['requests']} of {rep['requests']} failed ({why})")
    return EXIT_OK


# --- argument parsing --------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (plus exit 2), like every other failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see --help)\n")


def _bounded(kind: type, lo: float, hi: float | None = None):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            limit = f"between {lo:g} and {hi:g}" if hi is not None else f">= {lo:g}"
            raise argparse.ArgumentTypeError(f"must be {limit}: {text!r}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _size_arg(text: str) -> int | str:
    """Validated here (nothing is sent on a typo); sent as the user wrote it so the daemon
    persists '1.5GiB' rather than 1610612736."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"budget must be > 0: {text!r}")
    return int(text) if text.strip().isdigit() else text.strip()


def _url_arg(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in URL: {text!r}") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="memspec-ctl",
        description="Inspect and steer a running MemSpec daemon.",
        epilog="Exit status: 0 ok, 1 daemon error, 2 usage, 3 unreachable, 4 unauthorized.",
    )
    p.add_argument(
        "--url",
        type=_url_arg,
        default=os.environ.get("MEMSPEC_URL") or DEFAULT_URL,
        help="daemon URL (env MEMSPEC_URL, default %(default)s)",
    )
    p.add_argument(
        "--key",
        default=os.environ.get("MEMSPEC_ADMIN_KEY"),
        help="admin key, sent as a bearer token (env MEMSPEC_ADMIN_KEY)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MEMSPEC_API_KEY"),
        help="key for /v1 (bench; env MEMSPEC_API_KEY; default: the admin key)",
    )
    p.add_argument(
        "--timeout",
        type=_bounded(float, 0.1, 3600),
        default=10.0,
        help="seconds per HTTP request (default %(default)s)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("status", help="budget, memory, policy, drafts, throughput")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("drafts", help="list, load, evict, pin or unpin drafts")
    dsub = d.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = dsub.add_parser("list", help="the draft pool")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_drafts)
    for action, help_ in (
        ("load", "make a draft resident now"),
        ("evict", "drop a resident draft"),
        ("pin", "keep a draft resident (never evicted)"),
        ("unpin", "let the scheduler evict it again"),
    ):
        a = dsub.add_parser(action, help=help_)
        a.add_argument("id", help="draft id (see `drafts list`)")
        a.add_argument("--json", action="store_true")
        a.set_defaults(func=cmd_drafts)

    t = sub.add_parser("tune", help="change a setting live (the daemon persists it)")
    tsub = t.add_subparsers(dest="setting", required=True, metavar="SETTING")
    for name, field, kind, help_ in (
        ("budget", "budget", _size_arg, "memory budget, e.g. 1.5GiB, 800MB, 123456"),
        ("policy", "policy", str, "policy name"),
        ("k-max", "k_max", _bounded(int, 0, 64), "longest draft per round (0: no drafting)"),
        ("n-ctx", "n_ctx", _bounded(int, 16), "context length in tokens"),
    ):
        a = tsub.add_parser(name, help=help_)
        a.add_argument("value", type=kind, metavar=name.upper().replace("-", "_"))
        a.add_argument("--json", action="store_true")
        a.set_defaults(func=cmd_tune, field=field)

    w = sub.add_parser("watch", help="live status view")
    w.add_argument("--interval", type=_bounded(float, 0.1), default=2.0, help="seconds (default 2)")
    w.add_argument("--count", type=_bounded(int, 1), help="stop after N refreshes")
    w.set_defaults(func=cmd_watch)

    b = sub.add_parser("bench", help="short streaming load against a local daemon")
    b.add_argument("--requests", type=_bounded(int, 1, BENCH_MAX_REQUESTS), default=8)
    b.add_argument("--concurrency", type=_bounded(int, 1, BENCH_MAX_CONCURRENCY), default=2)
    b.add_argument("--max-tokens", type=_bounded(int, 1, BENCH_MAX_TOKENS), default=64)
    b.add_argument(
        "--prompt", action="append", help="prompt (repeatable; requests cycle through them)"
    )
    b.add_argument("--model", help="model id (default: the first in /v1/models)")
    b.add_argument("--draft", help="request field `draft`: an id, none or auto")
    b.add_argument(
        "--time-limit",
        type=_bounded(float, 1, BENCH_MAX_TIME_S),
        default=120.0,
        help="stop after this many seconds; unfinished requests count as failures",
    )
    b.add_argument("--json", action="store_true", help="JSON report with every request")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(args.url, args.key, args.timeout) as client:
            return args.func(client, args)
    except CtlError as e:
        print(f"memspec-ctl: error: {e.message}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `memspec-ctl status | head`: nothing left to say
        # Point stdout at /dev/null so the interpreter's final flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # a bug or an odd answer: still one line, never a traceback
        msg = _one_line(str(e))
        print(f"memspec-ctl: error: unexpected {type(e).__name__}: {msg}", file=sys.stderr)
        return EXIT_SERVER


if __name__ == "__main__":
    sys.exit(main())
