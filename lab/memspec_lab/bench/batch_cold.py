"""`memspec bench batch --cold`: concurrent streams whose prompts are all new, against
llama.cpp's `llama-server -np N` in the same run.

The warm `bench batch` runs each level after an unmeasured pass over its prompts, so its
figure leaves prompt processing out; a server whose requests are new must pay it. Here:
- every measured request is a prompt sent to that server for the first time in the run
  (distinct held-out prompts, code and chats spread evenly over the levels; the warm-up uses
  others);
- memspec's prefix cache is off (`prefix_cache` 0) and so are llama-server's prompt caches
  beyond its slots (`--cache-reuse 0 --cache-ram 0`); each server keeps only what a slot
  holds, the common prefix of the slot's last prompt and the new one (a chat template's
  head), memspec by design and llama-server with `cache_prompt` (both report it as
  `cached_tokens`);
- memspec runs `draft` auto (what a client gets by default), llama-server plain decoding,
  both with N slots (`--parallel N`, `-np N`) and greedy;
- each level's prompts are then sent one at a time to a fresh server of the same config:
  the serial baseline on the same work (concurrent vs serial), and every prompt's solo
  answer. Under concurrency every memspec answer must equal its solo answer (greedy); the
  command exits non-zero when one does not. llama-server's are compared and recorded only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx

from memspec.config import Settings
from memspec.paths import use_data_dir
from memspec_lab.bench.batch import MemspecServer, _model_id, _run_level, plot
from memspec_lab.bench.peer_server import PeerServer
from memspec_lab.bench.workloads import BenchPrompt, load_workload

MEMSPEC = "memspec"
PEER = "llama-server"
WARMUP = 2  # prompts outside the measured ones, sent before each server's first level
# llama-server with no prompt reuse beyond a slot's own: no KV-shift reuse, no host-memory
# prompt cache. A slot's common prefix with its last prompt it keeps (`cache_prompt`), as
# memspec's engine does (until wave 3's fifth stop the bench turned that off for llama-server
# only, which gave memspec 4-9% of the prompt tokens free).
PEER_COLD_FLAGS = ["--cache-reuse", "0", "--cache-ram", "0"]
MEMSPEC_COLD_ENV = {"MEMSPEC_PREFIX_CACHE": "0"}
MISMATCH_SAMPLES = 5  # mismatching answers quoted in the report


def cold_prompts(n: int, warmup: int = WARMUP) -> tuple[list[BenchPrompt], list[BenchPrompt]]:
    """`n` distinct held-out prompts, the chats (at most half) spread evenly among the code
    completions so that every level gets the same mix; and `warmup` other code prompts."""
    code = load_workload("heldout", 1 << 20, ["code"])  # every HumanEval task
    chats = [p for p in load_workload("heldout", 1 << 20) if p.chat]
    n_chat = min(len(chats), n // 2)
    n_code = n - n_chat
    if n_code + warmup > len(code):
        most = len(code) - warmup + n_chat
        raise SystemExit(
            f"--cold needs {n} distinct prompts; the held-out set has {most}: "
            "fewer levels or a smaller --per-client"
        )
    out: list[BenchPrompt] = []
    ci = hi = 0
    for i in range(n):
        # Chat number hi goes where i/n first reaches hi/n_chat (an even spread).
        if hi < n_chat and i * n_chat >= hi * n:
            out.append(chats[hi])
            hi += 1
        else:
            out.append(code[ci])
            ci += 1
    return out, code[len(code) - warmup :]


def _body(p: BenchPrompt, max_tokens: int, ident: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    body["_id"] = ident
    if p.chat:
        return body | {"messages": [{"role": "user", "content": p.text}], "path": "chat"}
    return body | {"prompt": p.text, "path": "completions"}


def plan_levels(
    concurrency: list[int], per_client: int, max_tokens: int
) -> tuple[dict[int, list[dict[str, Any]]], list[dict[str, Any]], dict[str, int]]:
    """Each level's request bodies (disjoint prompts; `_id` numbers them across the run),
    the warm-up bodies, and the prompt counts."""
    sizes = [c * per_client for c in concurrency]
    prompts, warm = cold_prompts(sum(sizes))
    levels: dict[int, list[dict[str, Any]]] = {}
    at = 0
    for c, size in zip(concurrency, sizes, strict=True):
        levels[c] = [_body(p, max_tokens, at + i) for i, p in enumerate(prompts[at : at + size])]
        at += size
    warmup = [_body(p, max_tokens, -1 - i) for i, p in enumerate(warm)]
    counts = {
        "distinct": len(prompts),
        "chat": sum(p.chat for p in prompts),
        "code": sum(not p.chat for p in prompts),
        "warmup": len(warm),
    }
    return levels, warmup, counts


def _clients(bodies: list[dict[str, Any]], c: int) -> list[list[dict[str, Any]]]:
    """c clients, client i sending bodies i, i + c, ... one after another."""
    return [bodies[i::c] for i in range(c)]


def _passes(url: str) -> tuple[float, float] | None:
    """memspec's forward passes and the tokens they carried so far (/metrics), or None."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = {}
    for name in ("memspec_batch_tokens_count", "memspec_batch_tokens_sum"):
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        if m is None:
            return None
        found[name] = float(m.group(1))
    return found["memspec_batch_tokens_count"], found["memspec_batch_tokens_sum"]


def _measure(
    url: str,
    extra: dict[str, Any],
    levels: dict[int, list[dict[str, Any]]],
    warmup: list[dict[str, Any]],
    serial: bool,
    say: Any,
    label: str,
) -> dict[str, dict[str, Any]]:
    """Every level on the server at `url` (after the warm-up): concurrently, or (`serial`)
    one request at a time. Rows keep their texts, keyed by `_id`."""
    model = _model_id(url)
    asyncio.run(_run_level(url, model, _clients(warmup, len(warmup)), extra))
    rows: dict[str, dict[str, Any]] = {}
    for c, bodies in levels.items():
        say(f"bench batch --cold: {label}, {c} {'one at a time' if serial else 'concurrent'}")
        before = _passes(url)
        row = asyncio.run(_run_level(url, model, _clients(bodies, 1 if serial else c), extra))
        after = _passes(url)
        if before is not None and after is not None:  # memspec: what its passes carried
            row["forward_passes"] = int(after[0] - before[0])
            row["pass_tokens"] = int(after[1] - before[1])
        rows[str(c)] = row
    return rows


def _ratio(a: float | None, b: float | None, nd: int = 3) -> float | None:
    return round(a / b, nd) if a is not None and b else None


def _compare(
    conc: dict[str, dict[str, Any]], solo: dict[str, dict[str, Any]]
) -> tuple[dict[str, str], list[dict[str, Any]], int, int]:
    """Each concurrent answer against its solo answer: per level 'same/requests', the first
    mismatches, and the totals (same, requests). An error on either side is a mismatch."""
    per_level: dict[str, str] = {}
    mismatches: list[dict[str, Any]] = []
    same_all = total_all = 0
    for c, row in conc.items():
        other = solo.get(c)
        if other is None:  # concurrency 1: its answers are the solo answers
            continue
        same = 0
        for key, text in row["texts"].items():
            ref = other["texts"].get(key)
            if text is not None and text == ref:
                same += 1
            elif len(mismatches) < MISMATCH_SAMPLES:
                mismatches.append(
                    {"level": int(c), "request": int(key), "concurrent": text, "solo": ref}
                )
        per_level[c] = f"{same}/{len(row['texts'])}"
        same_all += same
        total_all += len(row["texts"])
    return per_level, mismatches, same_all, total_all


def run_cold_batch_bench(
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
    levels, warmup, counts = plan_levels(concurrency, per_client, max_tokens)
    serial_levels = {c: b for c, b in levels.items() if c > 1}
    report: dict[str, Any] = {
        "kind": "batch",
        "mode": "cold",
        "target": settings.target,
        "concurrency": concurrency,
        "parallel": slots,
        "per_client": per_client,
        "max_tokens": max_tokens,
        "workload": "heldout",
        "prompts": counts,
        "cpu_count": os.cpu_count(),
        "setup": {
            MEMSPEC: f"memspec serve --parallel {slots}, prefix_cache 0, draft auto",
            PEER: f"llama-server -np {slots} -cb {' '.join(PEER_COLD_FLAGS)}, "
            "cache_prompt true (a slot's own prefix), plain decoding",
        },
        "configs": {},  # system -> level -> the concurrent run
        "serial": {},  # system -> level -> the same prompts, one at a time, fresh server
    }
    binary = PeerServer.find() if peer else None
    if peer and binary is None:
        report["peer_missing"] = "llama-server not built: scripts/setup.sh --peer"
    # memspec, llama-server, llama-server, memspec: a box whose speed drifts over the run
    # (this one's does, by up to ~18% an hour) moves both systems alike.
    phases = [(MEMSPEC, False), (PEER, False), (PEER, True), (MEMSPEC, True)]
    for name, is_serial in phases:
        todo = serial_levels if is_serial else levels
        if not todo or (name == PEER and binary is None):
            continue
        key = "serial" if is_serial else "configs"
        if name == PEER:
            assert binary is not None
            peer_settings = settings.model_copy(update={"n_ctx": settings.n_ctx * slots})
            p = PeerServer(binary, peer_settings, ["-np", str(slots), "-cb", *PEER_COLD_FLAGS])
            try:
                report[key][PEER] = _measure(
                    p.url, {"cache_prompt": True}, todo, warmup, is_serial, say, PEER
                )
            finally:
                p.close()
            continue
        srv = MemspecServer(slots, config, settings.n_threads, env=MEMSPEC_COLD_ENV)
        try:
            report[key][MEMSPEC] = _measure(
                srv.url, {"draft": "auto"}, todo, warmup, is_serial, say, MEMSPEC
            )
            status = httpx.get(srv.url + "/admin/status", timeout=10).json()
            # Proof that nothing was reused from the prefix cache (capacity 0, no restores).
            cache = {k: status["prefix_cache"][k] for k in ("capacity", "restores")}
            report.setdefault("memspec_prefix_cache", {})[
                "serial" if is_serial else "concurrent"
            ] = cache
            if not is_serial:
                report["memspec_slots"] = status["slots"]
        finally:
            srv.close()
    summarise_cold(report)
    return report


def summarise_cold(report: dict[str, Any]) -> None:
    """Solo checks, concurrent vs serial, memspec / llama-server per level; texts dropped."""
    configs, serial = report["configs"], report["serial"]
    checks: dict[str, Any] = {}
    for name, rows in configs.items():
        per_level, mismatches, same, total = _compare(rows, serial.get(name, {}))
        errors = sum(r["errors"] for r in rows.values()) + sum(
            r["errors"] for r in serial.get(name, {}).values()
        )
        checks[name] = {
            "identical": per_level,
            "compared": total,
            "same": same,
            "errors": errors,
            "mismatches": mismatches,
            # memspec must be exact (greedy, batch-invariant kernels); llama-server is recorded
            "passed": same == total and errors == 0,
            "enforced": name == MEMSPEC,
        }
        speedup = {}
        for c, row in rows.items():
            base = serial.get(name, {}).get(c) if int(c) > 1 else row
            if base is None:
                continue
            speedup[c] = {
                "serial_wall_s": base["wall_s"],
                "concurrent_wall_s": row["wall_s"],
                "x_serial": _ratio(base["wall_s"], row["wall_s"]),
            }
        report.setdefault("concurrent_vs_serial", {})[name] = speedup
    report["solo_check"] = checks
    mem, peer = configs.get(MEMSPEC, {}), configs.get(PEER, {})
    fields = (
        "aggregate_tokens_per_s",
        "wall_s",
        "ttft_p50_s",
        "ttft_p95_s",
        "per_stream_tokens_per_s_p50",
    )
    if mem and peer:
        vs: dict[str, Any] = {}
        cvs = report["concurrent_vs_serial"]
        for c in mem:
            if c not in peer:
                continue
            vs[c] = {f: _ratio(mem[c][f], peer[c][f]) for f in fields}
            a, b = cvs[MEMSPEC].get(c), cvs[PEER].get(c)
            vs[c]["x_serial"] = _ratio(a and a["x_serial"], b and b["x_serial"])
            same = sum(
                t is not None and t == peer[c]["texts"].get(k) for k, t in mem[c]["texts"].items()
            )
            vs[c]["answers_equal"] = f"{same}/{len(mem[c]['texts'])}"  # information only
        report["memspec_vs_llama_server"] = vs  # ratios memspec / llama-server
    report["summary"] = {
        name: {
            c: {f: r[f] for f in fields}
            | {"x_serial": report["concurrent_vs_serial"][name].get(c, {}).get("x_serial")}
            for c, r in rows.items()
        }
        for name, rows in configs.items()
    }
    for group in (configs, serial):
        for rows in group.values():
            for r in rows.values():
                r.pop("texts", None)


def cmd_batch_cold(args: argparse.Namespace, levels: list[int]) -> int:
    rep = run_cold_batch_bench(
        levels, args.per_client, args.max_tokens, args.config, args.parallel, not args.no_peer
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    if args.plot:
        plot(rep, Path(args.plot))
    for name, rows in rep["summary"].items():
        for c, r in rows.items():
            print(
                f"{name:13s} {c:>3s} streams: {r['aggregate_tokens_per_s']:7.1f} tokens/s, "
                f"wall {r['wall_s']:.2f} s, TTFT p50 {_fmt(r['ttft_p50_s'])} "
                f"p95 {_fmt(r['ttft_p95_s'])}, {_fmt(r['x_serial'], 'x')} serial"
            )
    for c, r in rep.get("memspec_vs_llama_server", {}).items():
        print(
            f"memspec / llama-server at {c}: tokens/s {_fmt(r['aggregate_tokens_per_s'], 'x')}, "
            f"wall {_fmt(r['wall_s'], 'x')}, TTFT p50 {_fmt(r['ttft_p50_s'], 'x')}"
        )
    failed = False
    for name, check in rep["solo_check"].items():
        verdict = "ok" if check["passed"] else "DIFFER" if check["enforced"] else "differ"
        print(
            f"{name} answers under concurrency equal to solo: {check['same']}/"
            f"{check['compared']}, {check['errors']} errors ({verdict})"
        )
        failed |= check["enforced"] and not check["passed"]
    if failed:
        print("memspec's answers under concurrency differ from its solo answers", file=sys.stderr)
        return 1
    return 0


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{' s' if unit == 's' else unit}"
