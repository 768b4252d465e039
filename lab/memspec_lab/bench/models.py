"""`memspec bench models`: two models under a budget that holds one target, memspec's residency
against Ollama's least-recently-used swap, on one arrival trace, one run.

The workload is what an Open WebUI user on a Jetson sends: code questions to the coder
(HumanEval prompts) and chat to a small model (the held-out chats), with Poisson arrivals and
bursts (a user pasting several questions at once). It is never tuned on. Both policies serve
the same trace on a fresh daemon each (memspec_lab.bench.batch.MemspecServer), with the same
settings but `residency`:
- `memspec`: predicted demand keeps the model that saves most loading, and a switch waits
  while the resident model's queued run goes on (at most 8x the switch's measured loads,
  capped by model_switch_wait_s: memspec.scheduler.residency);
- `lru`: first come first served, the least recently used idle model unloaded (Ollama's).

Per policy the report gives requests/s (requests over the makespan, first arrival to last
byte), p50/p95 time to first token and whole-request latency, loads, evictions, loads wasted
(evicted before serving a request) and abandoned, stall seconds (memspec_model_stall_
seconds_total), the peak modelled bytes against the budget and the peak measured RSS, and
whether every answer equals the other policy's (greedy: a policy must not change a token).

`--workload alternating` replaces the open-loop trace with closed-loop clients (`--clients`,
each sending `--per-client` requests one after another, alternating between the two models):
the thrash case. `--peers router` runs the same workload against llama.cpp's own router
(`llama-server --models-dir` holding the two files, `--models-max 1`), the peer a user would
pick, in the same run; its loads are counted from its /models status.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from memspec.catalog import ModelCatalog
from memspec.config import Settings
from memspec.targets import Targets
from memspec.units import format_size, parse_size
from memspec_lab.bench.batch import MemspecServer
from memspec_lab.bench.peer_server import PeerServer
from memspec_lab.bench.workloads import load_workload

POLICIES = ("memspec", "lru")
PEERS = ("router",)


@dataclass(frozen=True)
class Arrival:
    at_s: float  # after the trace's start
    role: str  # "code" or "chat"
    prompt_id: str
    text: str


def make_trace(
    n: int, rate: float, code_share: float, burst_every: int, burst: int, seed: int
) -> list[Arrival]:
    """`n` requests: Poisson arrivals at `rate` per second, each to the coder with probability
    `code_share`; every `burst_every` arrivals, `burst` more of the same kind at that instant."""
    rng = random.Random(seed)
    code = load_workload("heldout", per_category=40, categories=["code"])
    chat = [p for p in load_workload("heldout", per_category=8) if p.category != "code"]
    out: list[Arrival] = []
    t = 0.0
    while len(out) < n:
        t += rng.expovariate(rate)
        role = "code" if rng.random() < code_share else "chat"
        extra = burst if burst_every and (len(out) + 1) % burst_every == 0 else 0
        for _ in range(1 + extra):
            if len(out) >= n:
                break
            pool = code if role == "code" else chat
            p = pool[len(out) % len(pool)]
            out.append(Arrival(round(t, 3), role, p.id, p.text))
    return out


def make_alternating(clients: int, per_client: int) -> list[list[Arrival]]:
    """Closed loop: each client's requests, sent one after another, alternating between the
    coder and the chat model (client i starts with the coder when i is even)."""
    code = load_workload("heldout", per_category=40, categories=["code"])
    chat = [p for p in load_workload("heldout", per_category=8) if p.category != "code"]
    out = []
    for i in range(clients):
        mine = []
        for j in range(per_client):
            role = ("code", "chat")[(i + j) % 2]
            pool = code if role == "code" else chat
            p = pool[(i * per_client + j) % len(pool)]
            mine.append(Arrival(0.0, role, p.id, p.text))
        out.append(mine)
    return out


@dataclass(frozen=True)
class Workload:
    """An open-loop trace (arrivals at their times) or closed-loop clients."""

    trace: list[Arrival] | None = None
    clients: list[list[Arrival]] | None = None

    def arrivals(self) -> list[Arrival]:
        return self.trace if self.trace is not None else [a for c in self.clients or [] for a in c]


def replay(url: str, work: Workload, names: dict[str, str], max_tokens: int) -> list[dict]:
    """Every request of `work` against `url`, streamed; results in arrivals() order."""
    arrivals = work.arrivals()
    results: list[dict[str, Any]] = [{} for _ in arrivals]
    t0 = time.monotonic()

    def fire(i: int, a: Arrival) -> None:
        delay = t0 + a.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        results[i] = _stream(url, names[a.role], a.text, max_tokens) | {"t0": t0}

    def client(first: int, mine: list[Arrival]) -> None:
        for j, a in enumerate(mine):
            fire(first + j, a)

    threads = []
    if work.trace is not None:
        threads = [threading.Thread(target=fire, args=(i, a)) for i, a in enumerate(arrivals)]
    else:
        first = 0
        for mine in work.clients or []:
            threads.append(threading.Thread(target=client, args=(first, mine)))
            first += len(mine)
    for th in threads:
        th.daemon = True
        th.start()
    for th in threads:
        th.join()
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests/s over the makespan (first send to last byte), TTFT and latency p50/p95."""
    ok = [r for r in results if not r.get("error")]
    t0 = min((r["t0"] for r in results if "t0" in r), default=0.0)
    makespan = max((r["end"] for r in ok), default=t0) - t0
    ttfts = sorted(r["ttft_s"] for r in ok)
    latencies = sorted(r["end"] - r["sent"] for r in ok)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[int(q * (len(xs) - 1))], 3) if xs else None

    return {
        "requests": len(results),
        "failed": [r.get("error") for r in results if r.get("error")],
        "makespan_s": round(makespan, 2),
        "requests_per_s": round(len(ok) / makespan, 4) if makespan > 0 else 0.0,
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / makespan, 2) if makespan else 0.0,
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p95_s": pct(ttfts, 0.95),
        "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "latency_p95_s": pct(latencies, 0.95),
        "answers": [r.get("answer") for r in results],
    }


def default_budget(settings: Settings, coder: str, chat: str) -> int:
    """One target plus half the other: never both targets (the switch is forced)."""
    catalog = ModelCatalog(settings)
    needs = []
    for name in (coder, chat):
        model = catalog.find(name)
        if model is None:
            raise SystemExit(f"bench models: no model {name!r} in the models dir")
        needs.append(Targets(catalog, None, lambda: 0).need_bytes(model, settings))  # type: ignore[arg-type]
    return max(needs) + min(needs) // 2


def _stream(url: str, model: str, text: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    first: float | None = None
    answer, tokens, error = "", 0, None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
            if r.status_code != 200:
                r.read()
                return {"error": f"{r.status_code} {r.text[:200]}", "sent": sent}
            for line in r.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                for c in event.get("choices") or []:
                    delta = (c.get("delta") or {}).get("content") or ""
                    if delta and first is None:
                        first = time.monotonic()
                    answer += delta
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        error = str(e)
    end = time.monotonic()
    return {
        "sent": sent,
        "ttft_s": (first or end) - sent,
        "end": end,
        "tokens": tokens,
        "answer": answer,
        "error": error,
    }


def _metric_sum(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def run_policy(
    policy: str,
    work: Workload,
    names: dict[str, str],
    env: dict[str, str],
    parallel: int,
    n_threads: int | None,
    max_tokens: int,
) -> dict[str, Any]:
    """One daemon with `residency = policy`, the workload replayed against it."""
    state = tempfile.TemporaryDirectory(prefix="memspec-bench-models-")  # nothing learnt carries
    env = env | {"MEMSPEC_RESIDENCY": policy, "MEMSPEC_STATE_DIR": state.name}
    server = MemspecServer(parallel, None, n_threads, env=env)
    peak = {"modelled": 0, "measured": 0}
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.25):
            try:
                st = httpx.get(server.url + "/admin/status", timeout=10).json()
            except (httpx.HTTPError, ValueError):
                continue
            used = st.get("used_bytes") or {}
            peak["modelled"] = max(peak["modelled"], int(used.get("modelled") or 0))
            peak["measured"] = max(peak["measured"], int(used.get("measured") or 0))

    try:
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        results = replay(server.url, work, names, max_tokens)
        stop.set()
        poller.join()
        st = httpx.get(server.url + "/admin/status", timeout=30).json()
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        stop.set()
        server.close()
        state.cleanup()
    rows = {m["name"]: m for m in st.get("models", [])}

    def per_model(key: str) -> dict[str, Any]:
        return {n: rows[n].get(key) for n in names.values() if n in rows}

    return (
        {"policy": policy}
        | summarize(results)
        | {
            "loads": per_model("loads"),
            "evictions": per_model("evictions"),
            "loads_wasted": per_model("loads_wasted"),
            "loads_abandoned": per_model("loads_abandoned"),
            "load_s": per_model("load_s_total"),
            "stall_s": round(_metric_sum(metrics, "memspec_model_stall_seconds_total"), 2),
            "budget_bytes": st.get("budget_bytes"),
            "peak_modelled_bytes": peak["modelled"],
            "peak_measured_bytes": peak["measured"],
        }
    )


def _router_status(url: str) -> dict[str, str]:
    """Each model's state in llama-server's router (/models): loaded, loading, unloaded..."""
    out = {}
    for m in httpx.get(url + "/models", timeout=10).json().get("data", []):
        status = m.get("status")
        value = status.get("value") if isinstance(status, dict) else status
        out[str(m.get("id"))] = str(value)
    return out


def run_router(
    binary: Path,
    settings: Settings,
    files: dict[str, Path],
    work: Workload,
    max_tokens: int,
) -> dict[str, Any]:
    """llama-server's router on a models dir holding the two files (hard links), at most one
    loaded (`--models-max 1`, its LRU), the workload replayed against it; its loads are the
    transitions to `loaded` seen on /models (polled every 0.1 s)."""
    with tempfile.TemporaryDirectory(prefix="memspec-bench-router-") as tmp:
        for path in files.values():
            dest = Path(tmp) / path.name
            try:
                dest.hardlink_to(path.resolve())
            except OSError:
                dest.symlink_to(path.resolve())
        server = PeerServer(binary, settings, ["--models-max", "1"], models=["--models-dir", tmp])
        try:
            ids = list(_router_status(server.url))
            names = {}
            for role, path in files.items():
                found = [i for i in ids if i == path.stem or path.stem in i or path.name in i]
                if not found:
                    raise SystemExit(f"bench models: the router lists no {path.name}: {ids}")
                names[role] = found[0]
            loads = dict.fromkeys(names.values(), 0)
            seen: dict[str, str] = {}
            stop = threading.Event()

            def poll() -> None:
                while not stop.wait(0.1):
                    try:
                        now = _router_status(server.url)
                    except (httpx.HTTPError, ValueError):
                        continue
                    for model, value in now.items():
                        if value == "loaded" and seen.get(model) != "loaded" and model in loads:
                            loads[model] += 1
                        seen[model] = value

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            results = replay(server.url, work, names, max_tokens)
            stop.set()
            poller.join()
        finally:
            server.close()
    return (
        {"peer": "llama-server router (--models-max 1)"}
        | summarize(results)
        | {
            "loads": loads,
        }
    )


def run_models_bench(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings.load(config=args.config) if args.config else Settings()
    settings = settings.model_copy(update={"n_ctx": args.n_ctx, "parallel": args.parallel})
    catalog = ModelCatalog(settings)
    coder, chat = catalog.find(args.coder), catalog.find(args.chat)
    for asked, model in ((args.coder, coder), (args.chat, chat)):
        if model is None:
            raise SystemExit(f"bench models: no model {asked!r} in the models dir")
    assert coder is not None and chat is not None
    # The coder is the daemons' target: the default, loaded at start.
    settings = settings.model_copy(update={"target": str(coder.path), "model_name": None})
    names = {"code": args.coder, "chat": args.chat}
    budget = parse_size(args.budget) if args.budget else default_budget(settings, *names.values())
    env = {
        "MEMSPEC_TARGET": str(coder.path),
        "MEMSPEC_BUDGET": str(budget),
        "MEMSPEC_N_CTX": str(args.n_ctx),
        "MEMSPEC_KEEP_ALIVE": args.keep_alive,
        "MEMSPEC_MODEL_SWITCH_WAIT_S": str(args.switch_wait_s),
    }
    if args.workload == "alternating":
        work = Workload(clients=make_alternating(args.clients, args.per_client))
        what = f"{args.clients} clients x {args.per_client} requests, alternating"
    else:
        trace = make_trace(
            args.requests, args.rate, args.code_share, args.burst_every, args.burst, args.seed
        )
        work = Workload(trace=trace)
        what = f"{len(trace)} requests over {trace[-1].at_s:.0f} s"
    binary = Path(args.llama_server) if args.llama_server else PeerServer.find()
    if args.peers and binary is None:
        raise SystemExit(
            "bench models: --peers router needs llama-server (scripts/build_peer.sh, or "
            "--llama-server PATH)"
        )
    print(
        f"bench models: {what}, coder {args.coder}, chat {args.chat}, budget {format_size(budget)}",
        flush=True,
    )
    runs: dict[str, dict[str, Any]] = {}
    for policy in args.policies:
        print(f"  {policy} ...", flush=True)
        runs[policy] = run_policy(
            policy, work, names, env, args.parallel, args.n_threads, args.max_tokens
        )
        _say(policy, runs[policy])
    for peer in args.peers:
        assert binary is not None
        print(f"  {peer} ...", flush=True)
        peer_settings = settings.model_copy(update={"n_threads": args.n_threads})
        files = {"code": coder.path, "chat": chat.path}
        runs[peer] = run_router(binary, peer_settings, files, work, args.max_tokens)
        _say(peer, runs[peer])
    arrivals = work.arrivals()
    out: dict[str, Any] = {
        "command": "memspec bench models",
        "workload": args.workload,
        "coder": args.coder,
        "chat": args.chat,
        "budget_bytes": budget,
        "n_ctx": args.n_ctx,
        "parallel": args.parallel,
        "n_threads": args.n_threads,
        "max_tokens": args.max_tokens,
        "arrivals": [a.__dict__ | {"text": None} for a in arrivals],
        "runs": {p: {k: v for k, v in r.items() if k != "answers"} for p, r in runs.items()},
    }
    # Each run against memspec's: requests/s, and the answers that are the same (greedy).
    if "memspec" in runs:
        a = runs["memspec"]
        for other, b in runs.items():
            if other == "memspec":
                continue
            out[f"memspec_vs_{other}"] = {
                "requests_per_s": (
                    round(a["requests_per_s"] / b["requests_per_s"], 3)
                    if b["requests_per_s"]
                    else None
                ),
                "loads": [sum(a["loads"].values()), sum(b["loads"].values())],
                "answers_identical": sum(
                    x == y for x, y in zip(a["answers"], b["answers"], strict=True)
                ),
                "answers_compared": len(arrivals),
            }
    return out


def _say(name: str, r: dict[str, Any]) -> None:
    print(
        f"  {name}: {r['requests_per_s']:.3f} req/s, ttft p50 {r['ttft_p50_s']} s "
        f"p95 {r['ttft_p95_s']} s, latency p95 {r['latency_p95_s']} s, loads {r['loads']}, "
        f"failed {len(r['failed'])}",
        flush=True,
    )


def register(bsub: Any) -> None:
    b = bsub.add_parser(
        "models",
        help="two models under a one-target budget: memspec's residency against LRU and "
        "llama-server's router, one run",
    )
    b.add_argument("--coder", default="qwen2.5-coder:1.5b", help="gets the code requests")
    b.add_argument("--chat", default="smollm2:135m", help="gets the chat requests")
    b.add_argument("--budget", help="default: one target plus half the other (never both)")
    b.add_argument(
        "--workload",
        choices=("poisson", "alternating"),
        default="poisson",
        help="poisson: an open-loop trace; alternating: closed-loop clients alternating models",
    )
    b.add_argument("--requests", type=int, default=24, help="poisson: how many")
    b.add_argument("--rate", type=float, default=0.5, help="poisson: arrivals per second")
    b.add_argument("--code-share", type=float, default=0.5)
    b.add_argument("--burst-every", type=int, default=6, help="0: no bursts")
    b.add_argument("--burst", type=int, default=2, help="extra requests in a burst")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--clients", type=int, default=4, help="alternating: clients")
    b.add_argument("--per-client", type=int, default=4, help="alternating: requests each")
    b.add_argument("--max-tokens", type=int, default=32)
    b.add_argument("--n-ctx", type=int, default=1024)
    b.add_argument("--parallel", type=int, default=1, help="slots per model")
    b.add_argument("--n-threads", type=int)
    b.add_argument("--keep-alive", default="5m", help="both policies (Ollama's default)")
    b.add_argument("--switch-wait-s", type=float, default=10.0)
    b.add_argument("--policies", nargs="*", default=list(POLICIES), choices=POLICIES)
    b.add_argument(
        "--peers", nargs="*", default=[], choices=PEERS, help="router: llama-server's router"
    )
    b.add_argument("--llama-server", help="default: data/bin/llama-server (build_peer.sh)")
    b.add_argument("--config", help="settings TOML for the daemons")
    b.add_argument("--out", required=True, help="JSON report")
    b.set_defaults(func=cmd_models_bench)


def cmd_models_bench(args: argparse.Namespace) -> int:
    rep = run_models_bench(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print(json.dumps({k: v for k, v in rep.items() if k != "arrivals"}, indent=2))
    return 0
