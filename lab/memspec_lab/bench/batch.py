"""`memspec bench batch`: throughput and latency of concurrent streams, memspec vs a peer.

For each concurrency c, c clients each stream the same share of a held-out prompt set
(HumanEval code completions and everyday chats: memspec_lab.bench.workloads, never tuned on)
against one server at a time, greedy:
- memspec's daemon (`memspec serve --parallel P`, started here) with `draft` auto and none;
- llama.cpp's own `llama-server` (data/bin/llama-server, `scripts/setup.sh --peer`) with
  `-np P` slots and continuous batching, plain and with its n-gram speculation.
Each (config, c) reports aggregate tokens/s (all streams' tokens over the wall time), per-stream
tokens/s, TTFT p50/p95 and errors; auto's answers are compared with none's (greedy: they must
be equal). Each level is measured after an unmeasured pass over its prompts, so every config
finds them in its server's prompt cache alike. One run, configs measured one after another on
an otherwise idle machine. `--cold` measures new prompts instead, prompt processing included
(memspec_lab.bench.batch_cold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from memspec.config import Settings
from memspec.ctl.client import async_client, percentile, stream_completion
from memspec.paths import use_data_dir
from memspec_lab.bench.peer_server import NGRAM, PeerServer
from memspec_lab.bench.workloads import load_workload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no healthy server at {url} within {timeout_s:.0f} s")


class MemspecServer:
    """`memspec serve` in a subprocess, on a free loopback port."""

    def __init__(
        self,
        parallel: int,
        config: str | None,
        n_threads: int | None,
        env: dict[str, str] | None = None,
    ):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "memspec.cli", "serve", "--port", str(self.port)]
        cmd += ["--parallel", str(parallel), "--log-level", "warning"]
        if config:
            cmd += ["--config", config]
        if n_threads:
            cmd += ["--n-threads", str(n_threads)]
        # `env` on top of ours (PYTHONPATH included: the daemon runs the code this bench runs).
        # MEMSPEC_BENCH_SERVER_LOG: where the daemon's output goes (default: nowhere).
        log = os.environ.get("MEMSPEC_BENCH_SERVER_LOG")
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | (env or {})
        )
        try:
            _wait_health(self.url, self.proc, 900)  # a first start calibrates the batch costs
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_calibrated(self, timeout_s: float = 900) -> float:
        """Seconds waited until no resident model is still calibrating: a model whose costs
        no cache holds is served plain at once and calibrated while the engine is idle, so a
        bench that measures speculation waits for it (the wait leaves the engine idle)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            rows = httpx.get(self.url + "/admin/status", timeout=30).json().get("models", [])
            if not any(r.get("calibration") == "calibrating" for r in rows):
                return round(time.monotonic() - t0, 2)
            time.sleep(1.0)
        raise RuntimeError(f"still calibrating after {timeout_s:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _requests(per_client: int, concurrency: int, max_tokens: int) -> list[list[dict]]:
    """Client i's request bodies (the same set for every config at this concurrency)."""
    prompts = load_workload("heldout", per_category=4)
    bodies = []
    for i in range(per_client * concurrency):
        p = prompts[i % len(prompts)]
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if p.chat:
            body |= {"messages": [{"role": "user", "content": p.text}], "path": "chat"}
        else:
            body |= {"prompt": p.text, "path": "completions"}
        bodies.append(body)
    return [bodies[c::concurrency] for c in range(concurrency)]


async def _run_level(
    url: str, model: str, clients: list[list[dict]], extra: dict[str, Any]
) -> dict[str, Any]:
    """Each client sends its bodies one after another, all clients at once. A body's `path`
    picks the endpoint and its `_id` (default: client * 1000 + j) keys its text."""
    results: list[tuple[int, dict[str, Any]]] = []

    async with async_client(url, None, 600.0, len(clients)) as http:

        async def client(c: int, bodies: list[dict]) -> None:
            for j, b in enumerate(bodies):
                path = "/v1/chat/completions" if b["path"] == "chat" else "/v1/completions"
                body = {k: v for k, v in b.items() if k != "path" and not k.startswith("_")}
                body |= {"model": model} | extra
                key = int(b.get("_id", c * 1000 + j))
                try:
                    resp, s = await stream_completion(http, path, body)
                except (httpx.HTTPError, ValueError) as e:
                    results.append((key, {"error": f"{type(e).__name__}: {e}"}))
                    continue
                if s is None or s.error is not None:
                    err = f"HTTP {resp.status_code}" if s is None else str(s.error)[:200]
                    results.append((key, {"error": err}))
                    continue
                tokens = s.usage_tokens or s.text_events
                row = {"text": s.text, "tokens": tokens, "ttft": s.ttft_s, "s": s.latency_s}
                row |= {"prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens}
                results.append((key, row))

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, b) for c, b in enumerate(clients)))
        wall = time.perf_counter() - t0
    ok = [r for _, r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    per_stream = [r["tokens"] / r["s"] for r in ok if r["s"] > 0]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r["error"] for _, r in results if "error" in r})[:3],
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "per_stream_tokens_per_s": round(sum(per_stream) / len(per_stream), 2)
        if per_stream
        else 0.0,
        "per_stream_tokens_per_s_p50": _round(percentile(per_stream, 50)),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        # What the prompts cost: tokens sent, and those the server reused (usage), if it said.
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "texts": {str(k): r.get("text") for k, r in sorted(results)},
    }


def _round(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _model_id(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=10).json()
    return data["data"][0]["id"]


def run_batch_bench(
    concurrency: list[int],
    per_client: int = 2,
    max_tokens: int = 64,
    config: str | None = None,
    parallel: int | None = None,
    peer: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    settings = Settings.load(config)
    use_data_dir(settings.data_dir)  # where this process finds the target
    slots = parallel or max(concurrency)
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    report: dict[str, Any] = {
        "kind": "batch",
        "concurrency": concurrency,
        "parallel": slots,
        "per_client": per_client,
        "max_tokens": max_tokens,
        "workload": "heldout",
        "cpu_count": os.cpu_count(),
        "configs": {},
    }
    levels = {c: _requests(per_client, c, max_tokens) for c in concurrency}

    def measure(url: str, configs: dict[str, dict[str, Any]]) -> None:
        """Every level of every config; at each level the configs run back to back, their
        order alternating from level to level (drift on a shared box falls on both)."""
        model = _model_id(url)
        for extra in configs.values():  # warm-up
            asyncio.run(_run_level(url, model, levels[concurrency[0]], extra))
        for i, c in enumerate(concurrency):
            # Unmeasured first: the level's prompts then sit in the daemon's prefix cache for
            # every config alike. Else the config run first paid every prefill and the next
            # found them cached (`auto` 0.86x `none` at 8 streams, then 1.2x at 4, by order).
            asyncio.run(_run_level(url, model, levels[c], next(iter(configs.values()))))
            names = list(configs) if i % 2 == 0 else list(reversed(configs))
            for name in names:
                say(f"bench batch: {name}, {c} concurrent")
                row = asyncio.run(_run_level(url, model, levels[c], configs[name]))
                report["configs"].setdefault(name, {})[str(c)] = row

    srv = MemspecServer(slots, config, settings.n_threads)
    try:
        measure(srv.url, {"memspec auto": {"draft": "auto"}, "memspec none": {"draft": "none"}})
        status = httpx.get(srv.url + "/admin/status", timeout=10).json()
        report["memspec_slots"] = status.get("slots")
    finally:
        srv.close()
    binary = PeerServer.find() if peer else None
    if binary is not None:
        for name, flags in (("llama-server plain", []), ("llama-server ngram-simple", NGRAM)):
            ctx = settings.n_ctx * slots
            peer_settings = settings.model_copy(update={"n_ctx": ctx})
            p = PeerServer(binary, peer_settings, flags + ["-np", str(slots), "-cb"])
            try:
                # Its prompt cache on, as memspec's prefix cache is: each level is measured
                # after an unmeasured pass over its prompts, on both servers.
                measure(p.url, {name: {"cache_prompt": True}})
            finally:
                p.close()
    elif peer:
        report["peer_missing"] = "llama-server not built: scripts/setup.sh --peer"
    _summarise(report)
    return report


def _summarise(report: dict[str, Any]) -> None:
    configs = report["configs"]
    auto, none = configs.get("memspec auto", {}), configs.get("memspec none", {})
    same = total = 0
    for c, row in auto.items():
        for k, text in row["texts"].items():
            other = none.get(c, {}).get("texts", {}).get(k)
            if text is not None and other is not None:
                total += 1
                same += text == other
    report["auto_vs_none_identical"] = f"{same}/{total}"
    first = str(report["concurrency"][0])
    summary = {}
    for name, rows in configs.items():
        base = rows[first]["aggregate_tokens_per_s"] or 1.0
        summary[name] = {
            c: {
                "aggregate_tokens_per_s": r["aggregate_tokens_per_s"],
                "x_concurrency_1": round(r["aggregate_tokens_per_s"] / base, 2),
                "ttft_p50_s": r["ttft_p50_s"],
            }
            for c, r in rows.items()
        }
    report["summary"] = summary
    best_peer = {
        c: max(
            (rows[c]["aggregate_tokens_per_s"] for n, rows in configs.items() if "llama" in n),
            default=None,
        )
        for c in map(str, report["concurrency"])
    }
    if auto and any(v for v in best_peer.values()):
        report["memspec_auto_vs_best_peer"] = {
            c: round(auto[c]["aggregate_tokens_per_s"] / v, 3) if v else None
            for c, v in best_peer.items()
        }
    for rows in configs.values():  # texts were for the comparison only
        for r in rows.values():
            r.pop("texts", None)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = report["concurrency"]
    for name, rows in report["configs"].items():
        ax1.plot(xs, [rows[str(c)]["aggregate_tokens_per_s"] for c in xs], "o-", label=name)
        ax2.plot(xs, [rows[str(c)]["ttft_p50_s"] or 0 for c in xs], "o-", label=name)
    ax1.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", xscale="log", xticks=xs)
    ax2.set(xlabel="concurrent streams", ylabel="TTFT p50 (s)", xscale="log", xticks=xs)
    for ax in (ax1, ax2):
        ax.set_xticklabels([str(c) for c in xs])
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"memspec bench batch ({report['workload']}, {report['max_tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(bsub: Any) -> None:
    b = bsub.add_parser("batch", help="concurrent streams: aggregate tokens/s, TTFT, vs a peer")
    b.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    b.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--parallel", type=int, help="daemon slots (default: the highest level)")
    b.add_argument("--no-peer", action="store_true", help="skip llama-server")
    b.add_argument(
        "--cold",
        action="store_true",
        help="every request a new prompt, prefix caches off in both servers; each level's "
        "prompts also run one at a time on a fresh server (serial baseline, solo answers)",
    )
    b.add_argument("--config", help="settings TOML for the daemon")
    b.add_argument("--out", required=True, help="JSON report")
    b.add_argument("--plot", help="PNG of tokens/s and TTFT against concurrency")
    b.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"--concurrency takes integers: {args.concurrency!r}") from None
    if not levels or levels[0] < 1:
        raise SystemExit("--concurrency needs levels of at least 1")
    if args.cold:
        from memspec_lab.bench.batch_cold import cmd_batch_cold

        return cmd_batch_cold(args, levels)
    rep = run_batch_bench(
        levels, args.per_client, args.max_tokens, args.config, args.parallel, not args.no_peer
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    if args.plot:
        plot(rep, Path(args.plot))
    for name, rows in rep["summary"].items():
        cells = ", ".join(f"{c}: {r['aggregate_tokens_per_s']:.1f}" for c, r in rows.items())
        print(f"{name:28s} tokens/s by concurrency  {cells}")
    print(f"auto vs none identical: {rep['auto_vs_none_identical']}")
    return 0
