"""`memspec bench daemon`: the daemon over HTTP beside llama-server, as a user meets both.

One request at a time, warm (one unmeasured request per server), the same held-out prompts
(HumanEval code completions on /v1/completions, everyday chats on /v1/chat/completions), greedy,
`--max-tokens` tokens, each prompt's best of `--passes` passes by client wall time. Prompt
caches are off on both sides (llama-server `cache_prompt: false`, memspec `prefix_cache 0`), and
the prompts are visited in turn, so every pass pays its prefill. Servers run one at a time:
- memspec (`memspec serve --parallel 1`): `draft` none (plain) and auto (its policy);
- llama-server (data/bin/llama-server, `--jinja`: the GGUF's chat template, as memspec uses):
  plain, its n-gram speculation (ngram-simple n3 m8) and, where the target has a sibling, `-md`.

Each memspec request's wall time is split with the server's own figures (the response's
`memspec` object): `outside` (HTTP, parsing, queue, template and tokenisation, the response:
wall less the generation's elapsed time), `prefill`, the rounds' phases, and `loop` (elapsed
less the phases: the engine between rounds). The CPU time each of the daemon's threads spent
during the measured requests is read from /proc (threads are named: memspec-engine with the
llama.cpp workers it starts, memspec-drafts for draft loads and calibration, the rest is the
HTTP side), so work done on other threads meanwhile shows. `ceiling` is the tokens/s the same
rounds would give if drafting were free (elapsed less the draft phases): on a 2-core CPU the
verification's cost bounds what any draft can win.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from memspec.config import Settings
from memspec.drafts.family import find_siblings
from memspec.paths import resolve_model_path
from memspec_lab.bench.batch import MemspecServer
from memspec_lab.bench.peer_server import NGRAM, PeerServer
from memspec_lab.bench.workloads import BenchPrompt, load_workload

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
MEMSPEC_CONFIGS = {"memspec plain": "none", "memspec auto": "auto"}
DRAFT_PHASES = ("draft_catchup", "draft_steps")


def _body(p: BenchPrompt, max_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "seed": 0}
    if p.chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": p.text}]}
    return "/v1/completions", body | {"prompt": p.text}


def _text(out: dict[str, Any]) -> str:
    choice = out["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"] or ""


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (/proc/PID/task/*/comm), summed over threads of one name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended between the listing and the read
        out[comm] = out.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = before.keys() | after.keys()
    return {n: round(after.get(n, 0.0) - before.get(n, 0.0), 3) for n in sorted(names)}


def _split(wall: float, stats: dict[str, Any]) -> dict[str, float]:
    """A memspec request's wall seconds, part by part (they add up to `wall`)."""
    phases = {k: v / 1e3 for k, v in (stats.get("phases_ms") or {}).items()}
    elapsed = stats["elapsed_ms"] / 1e3
    parts = {"outside": wall - elapsed} | phases
    parts["loop"] = elapsed - sum(phases.values())
    return {k: round(v, 4) for k, v in parts.items()}


def _measure(
    url: str,
    prompts: list[BenchPrompt],
    passes: int,
    max_tokens: int,
    extra: dict[str, Any],
    pid: int | None,
) -> dict[str, Any]:
    """Each prompt `passes` times (visited in turn), after one unmeasured request."""
    rows: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=url, timeout=900) as http:
        path, body = _body(prompts[-1], 8)
        http.post(path, json=body | extra).raise_for_status()  # warm
        cpu0 = _thread_cpu(pid) if pid else {}
        t0 = time.perf_counter()
        for _ in range(passes):
            for p in prompts:
                path, body = _body(p, max_tokens)
                start = time.perf_counter()
                r = http.post(path, json=body | extra)
                wall = time.perf_counter() - start
                r.raise_for_status()
                out = r.json()
                row = {
                    "id": p.id,
                    "kind": "chat" if p.chat else "code",
                    "wall_s": round(wall, 4),
                    "tokens": out["usage"]["completion_tokens"],
                    "prompt_tokens": out["usage"]["prompt_tokens"],
                    "text": _text(out),
                }
                if "memspec" in out:
                    row["memspec"] = out["memspec"]
                    row["split_s"] = _split(wall, out["memspec"])
                if "timings" in out:  # llama-server's own
                    row["timings"] = out["timings"]
                best = rows.get(p.id)
                if best is None or wall < best["wall_s"]:
                    rows[p.id] = row
        span = time.perf_counter() - t0
    result: dict[str, Any] = {"requests": list(rows.values()), "span_s": round(span, 2)}
    if pid:
        result["cpu_s_by_thread"] = _cpu_delta(cpu0, _thread_cpu(pid))
    return result


def _summarize(r: dict[str, Any]) -> dict[str, Any]:
    reqs = r["requests"]
    tokens = sum(q["tokens"] for q in reqs)
    wall = sum(q["wall_s"] for q in reqs)
    s: dict[str, Any] = {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 3) if wall else 0.0,
    }
    for kind in ("code", "chat"):
        sub = [q for q in reqs if q["kind"] == kind]
        w = sum(q["wall_s"] for q in sub)
        s[f"{kind}_tokens_per_s"] = round(sum(q["tokens"] for q in sub) / w, 3) if w else None
    if reqs and "split_s" in reqs[0]:
        parts: dict[str, float] = {}
        for q in reqs:
            for k, v in q["split_s"].items():
                parts[k] = parts.get(k, 0.0) + v
        s["split_s"] = {k: round(v, 3) for k, v in parts.items()}
        free = wall - sum(parts.get(k, 0.0) for k in DRAFT_PHASES)
        s["ceiling_tokens_per_s"] = round(tokens / free, 3) if free > 0 else None
        s["proposed"] = sum(q["memspec"]["proposed"] for q in reqs)
        s["accepted"] = sum(q["memspec"]["accepted"] for q in reqs)
    if reqs and "timings" in reqs[0]:
        s["server_prompt_s"] = round(sum(q["timings"]["prompt_ms"] for q in reqs) / 1e3, 3)
        s["server_predicted_s"] = round(sum(q["timings"]["predicted_ms"] for q in reqs) / 1e3, 3)
    if "cpu_s_by_thread" in r:
        s["cpu_s_by_thread"] = r["cpu_s_by_thread"]
    return s


def run_daemon_bench(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_workload("heldout", args.prompts)
    prompts = [p for p in prompts if not p.chat][: args.prompts] + [p for p in prompts if p.chat][
        : args.prompts
    ]
    configs = set(args.configs.split(",")) if args.configs else None
    report: dict[str, Any] = {
        "target": args.target,
        "max_tokens": args.max_tokens,
        "passes": args.passes,
        "prompts": [p.id for p in prompts],
        "cpu": _cpu_flags(),
        "machine": platform.machine(),
        "runs": {},
    }
    siblings = find_siblings(resolve_model_path(args.target))
    for threads in [int(t) for t in args.threads.split(",")]:
        runs: dict[str, Any] = {}
        for name, draft in MEMSPEC_CONFIGS.items():
            if configs and name not in configs:
                continue
            with tempfile.TemporaryDirectory(prefix="memspec-bench-daemon-") as state:
                env = {
                    "MEMSPEC_TARGET": args.target,
                    "MEMSPEC_PREFIX_CACHE": "0",
                    "MEMSPEC_STATE_DIR": state,
                    "MEMSPEC_N_CTX": str(args.n_ctx),
                }
                server = MemspecServer(1, args.config, threads, env=env)
                try:
                    calibration_wait_s = server.wait_calibrated()
                    runs[name] = _measure(
                        server.url,
                        prompts,
                        args.passes,
                        args.max_tokens,
                        {"draft": draft},
                        server.proc.pid,
                    )
                    runs[name]["calibration_wait_s"] = calibration_wait_s
                finally:
                    server.close()
            _say(threads, name, runs[name])
        binary = PeerServer.find()
        peers = {"llama-server plain": [], "llama-server ngram-simple": NGRAM}
        if siblings:  # the largest, as memspec's family takes it
            peers[f"llama-server -md {siblings[0].id}"] = ["-md", str(siblings[0].path)]
        settings = Settings.load(target=args.target, n_threads=threads, n_ctx=args.n_ctx)
        for name, flags in peers.items():
            if binary is None or args.no_peer or (configs and name not in configs):
                continue
            peer = PeerServer(binary, settings, [*flags, "--jinja"], timeout_s=300)
            try:
                runs[name] = _measure(
                    peer.url,
                    prompts,
                    args.passes,
                    args.max_tokens,
                    {"cache_prompt": False},
                    peer.proc.pid,
                )
            finally:
                peer.close()
            _say(threads, name, runs[name])
        report["runs"][str(threads)] = runs
        report.setdefault("summary", {})[str(threads)] = {n: _summarize(r) for n, r in runs.items()}
    return report


def _say(threads: int, name: str, run: dict[str, Any]) -> None:
    s = _summarize(run)
    print(
        f"[{threads} thread(s)] {name:32s} {s['tokens_per_s']:7.2f} tok/s "
        f"(code {s['code_tokens_per_s']}, chat {s['chat_tokens_per_s']})",
        flush=True,
    )


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "f16c")
                return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def register(bsub: Any) -> None:
    b = bsub.add_parser(
        "daemon",
        help="the daemon over HTTP beside llama-server: tokens/s and where a request's time goes",
    )
    b.add_argument("--target", default=DEFAULT_TARGET, help="GGUF in the models dir")
    b.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    b.add_argument("--prompts", type=int, default=4, help="code prompts, and as many chats")
    b.add_argument("--passes", type=int, default=2, help="each prompt's best of this many")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--n-ctx", type=int, default=2048)
    b.add_argument("--configs", help="only these, comma-separated (e.g. 'memspec plain')")
    b.add_argument("--no-peer", action="store_true", help="skip llama-server")
    b.add_argument("--config", help="settings TOML for the daemon")
    b.add_argument("--out", required=True, help="JSON report")
    b.set_defaults(func=cmd_daemon_bench)


def cmd_daemon_bench(args: argparse.Namespace) -> int:
    rep = run_daemon_bench(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print(json.dumps(rep["summary"], indent=2))
    return 0
