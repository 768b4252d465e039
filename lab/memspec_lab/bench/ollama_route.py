"""`memspec bench ollama`: the same chats streamed through Ollama's /api/chat and OpenAI's
/v1/chat/completions on one daemon, one run: does the Ollama wire cost anything?

Each held-out chat (memspec_lab.bench.workloads, never tuned on) goes through both routes in
pairs, the order alternating (ABBA) so that drift on a shared box falls on both. A request's
rate is its completion tokens over its wall time (request sent to last byte: prompt
processing, decoding and the wire), greedy. The report holds both routes' totals, the median
of the per-pair ratios with a bootstrap interval, and whether every answer was identical
across the routes (greedy: it must be).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from memspec.config import Settings
from memspec.paths import use_data_dir
from memspec_lab.bench.batch import MemspecServer
from memspec_lab.bench.workloads import load_workload


def _v1(http: httpx.Client, model: str, text: str, max_tokens: int, draft: str) -> tuple[str, int]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "draft": draft,
    }
    answer, tokens = "", 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            for c in event.get("choices") or []:
                answer += (c.get("delta") or {}).get("content") or ""
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return answer, tokens


def _ollama(
    http: httpx.Client, model: str, text: str, max_tokens: int, draft: str
) -> tuple[str, int]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "options": {"temperature": 0, "num_predict": max_tokens},
        "draft": draft,
    }  # streamed: Ollama's default
    answer, tokens = "", 0
    with http.stream("POST", "/api/chat", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.strip():
                continue
            event = json.loads(line)
            if "error" in event:
                raise RuntimeError(f"/api/chat failed mid-stream: {event['error']}")
            answer += (event.get("message") or {}).get("content") or ""
            if event.get("done"):
                tokens = event["eval_count"]
    return answer, tokens


ROUTES = {"/v1/chat/completions": _v1, "/api/chat": _ollama}


def _interval(ratios: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median ratio (a few percent off 1.0 can be chance)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def run_route_bench(
    config: str | None,
    repeat: int,
    max_tokens: int,
    draft: str,
    n_threads: int | None,
    say: Any = None,
) -> dict[str, Any]:
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    settings = Settings.load(config)
    use_data_dir(settings.data_dir)
    chats = [p for p in load_workload("heldout", per_category=2) if p.chat]
    rows: list[dict[str, Any]] = []
    srv = MemspecServer(1, config, n_threads or settings.n_threads)
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            for p in chats:  # warm-up: every prompt prefilled once, alike for both routes
                _v1(http, model, p.text, 4, draft)
            for i in range(repeat):
                for j, p in enumerate(chats):
                    order = list(ROUTES) if (i + j) % 2 == 0 else list(reversed(ROUTES))
                    row: dict[str, Any] = {"id": p.id, "pass": i}
                    for route in order:
                        t0 = time.perf_counter()
                        text, tokens = ROUTES[route](http, model, p.text, max_tokens, draft)
                        wall = time.perf_counter() - t0
                        row[route] = {"tokens": tokens, "wall_s": wall, "text": text}
                    say(
                        f"bench ollama: {p.id} pass {i}: "
                        + ", ".join(
                            f"{r} {row[r]['tokens'] / row[r]['wall_s']:.1f} tok/s" for r in ROUTES
                        )
                    )
                    rows.append(row)
    finally:
        srv.close()
    return summarise(rows, model, max_tokens, draft, n_threads or settings.n_threads)


def summarise(
    rows: list[dict[str, Any]], model: str, max_tokens: int, draft: str, n_threads: int | None
) -> dict[str, Any]:
    v1, ol = ROUTES
    totals = {
        r: sum(row[r]["tokens"] for row in rows) / sum(row[r]["wall_s"] for row in rows)
        for r in ROUTES
    }
    ratios = [
        (row[ol]["tokens"] / row[ol]["wall_s"]) / (row[v1]["tokens"] / row[v1]["wall_s"])
        for row in rows
        if row[ol]["tokens"] and row[v1]["tokens"]
    ]
    identical = sum(row[ol]["text"] == row[v1]["text"] for row in rows)
    lo, hi = _interval(ratios) if ratios else (None, None)
    for row in rows:
        for r in ROUTES:
            row[r].pop("text")
    return {
        "kind": "ollama_route",
        "model": model,
        "draft": draft,
        "max_tokens": max_tokens,
        "n_threads": n_threads,
        "cpu_count": os.cpu_count(),
        "pairs": len(rows),
        "tokens_per_s": {r: round(v, 2) for r, v in totals.items()},
        "api_chat_vs_v1_totals": round(totals[ol] / totals[v1], 3),
        "api_chat_vs_v1_median_of_pairs": round(statistics.median(ratios), 3) if ratios else None,
        "median_95_interval": [round(lo, 3), round(hi, 3)] if lo is not None else None,
        "answers_identical": f"{identical}/{len(rows)}",
        "rows": rows,
    }


def register(bsub: Any) -> None:
    b = bsub.add_parser(
        "ollama", help="the same chats streamed through /api/chat and /v1: tokens/s, one run"
    )
    b.add_argument("--repeat", type=int, default=3, help="passes over the held-out chats")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--draft", default="auto", help="auto, none, or a draft id (both routes)")
    b.add_argument("--n-threads", type=int, help="the daemon's threads (default: the setting)")
    b.add_argument("--config", help="settings TOML for the daemon")
    b.add_argument("--out", required=True, help="JSON report")
    b.set_defaults(func=cmd_route_bench)


def cmd_route_bench(args: argparse.Namespace) -> int:
    rep = run_route_bench(args.config, args.repeat, args.max_tokens, args.draft, args.n_threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print(
        json.dumps({k: v for k, v in rep.items() if k != "rows"}, indent=2),
    )
    return 0
