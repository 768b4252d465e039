"""`memspec bench runtime`: where each millisecond of plain decoding goes, and what the runtime
itself costs per token.

Part 1 (the real target): plain greedy decoding (draft none) of a few workload prompts, split
per generated token into llama.cpp's decode (`Backend.decode_s`), the backend's own work around
it (batch set-up, reading the logits), sampling (greedy: the argmax), detokenisation, streaming
(the daemon's hand-off of each text delta to an event loop that writes SSE chunks, in the
`memspec stream` config) and the engine's Python (the rest: policy, bookkeeping, the loop), and
the prompt's processing per prompt token. llama.cpp's `llama-server` (when
`scripts/setup.sh --peer` built it) decodes the same prompts in the same run; its own timings
(`prompt_ms`, `predicted_ms`) go in the same table.

Part 2 (a stub target): the same runtime (scheduler, working set, engine) over a backend whose
step costs next to nothing: it hands back precomputed logits rows of the target's vocabulary
size whose argmax walks a fixed cycle of tokens, so greedy decoding continues it and a
prompt-lookup draft (which finds the cycle in the prompt) is always right. Everything but the
stub's step is the runtime's own cost, per token for plain decoding and per round for
speculative decoding, against the goal of OWN_COST_GOAL_MS. It runs twice: `warm`, the step
doing nothing, and `cold`, the step sweeping a buffer larger than the CPU's caches as a model's
step does and then writing its logits rows (as llama.cpp's decode writes its logits buffer), so
the runtime's Python runs from cold caches as it does between real forward passes, on rows as
warm as a real step leaves them.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memspec.config import Settings
from memspec.engine.speculative import Generation, TokenCallback
from memspec.engine.types import SamplingParams
from memspec.memory.footprint import target_footprint
from memspec.memory.gguf_info import read_shape
from memspec.paths import models_dir, resolve_model_path
from memspec.runtime import Runtime
from memspec_lab.bench.peer_server import PeerServer, generated_tokens
from memspec_lab.bench.workloads import BenchPrompt, load_workload
from memspec_lab.stub_backend import COLD_SWEEP_MIB, StubBackend

# The runtime's own cost the project aims at, per plain token and per speculative round: on a
# Jetson a model step is 6-25 ms, so this is at most ~5% of the fastest step.
OWN_COST_GOAL_MS = 0.3
# The parts of a generated token's time, in the order the table prints them; they add up to
# the whole (`engine` is what is left when the others are taken out).
SPLIT = ("model", "backend", "sample", "detokenize", "stream", "engine")
# Where the `engine` part went (the rest of it: the loop between phases).
ENGINE_DETAIL = ("choose", "draft", "accept", "emit")


# --- the split ---------------------------------------------------------------------------


@dataclass
class Timed:
    """One generation and the backend counters around it."""

    gen: Generation
    decode_s: float  # Backend.decode_s over the whole generation (prompt included)
    forward_s: float

    def row(self, prompt_id: str) -> dict[str, Any]:
        g = self.gen
        return {
            "id": prompt_id,
            "tokens": g.completion_tokens,
            "rounds": g.rounds,
            "prompt_tokens": g.prompt_tokens,
            # Fed by the prefill (the last prompt token goes into the first round).
            "prefill_tokens": max(g.prompt_tokens - g.cached_tokens - 1, 0),
            "elapsed_s": g.elapsed_s,
            "decode_s": self.decode_s,
            "forward_s": self.forward_s,
            "phases": dict(g.phases),
            "token_ids": g.token_ids,
        }


def split(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Milliseconds per generated token in each part (SPLIT), per round, and of the prompt's
    processing per prompt token, over `rows` (Timed.row) together."""
    tokens = sum(r["tokens"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    ph = {p: sum(r["phases"].get(p, 0.0) for r in rows) for p in rows[0]["phases"]} if rows else {}
    prefill_s = ph.get("prefill", 0.0)
    decode_s = sum(r["decode_s"] for r in rows)
    gen_s = sum(r["elapsed_s"] for r in rows) - prefill_s
    parts = {
        "model": ph.get("verify_decode", 0.0),
        "backend": ph.get("verify_copy", 0.0),
        "sample": ph.get("sample", 0.0),
        "detokenize": ph.get("detokenize", 0.0),
        "stream": ph.get("stream", 0.0),
    }
    parts["engine"] = max(gen_s - sum(parts.values()), 0.0)
    detail = {
        "choose": ph.get("choose", 0.0),
        "draft": ph.get("draft_catchup", 0.0) + ph.get("draft_steps", 0.0),
        "accept": ph.get("accept", 0.0),
        "emit": ph.get("emit", 0.0),
    }
    detail["loop"] = max(parts["engine"] - sum(detail.values()), 0.0)
    own = gen_s - parts["model"]
    per_token = 1e3 / max(tokens, 1)
    per_round = 1e3 / max(rounds, 1)
    fed = sum(r["prefill_tokens"] for r in rows)
    prefill_model = max(decode_s - parts["model"], 0.0)  # decode_s outside the rounds
    return {
        "tokens": tokens,
        "rounds": rounds,
        "tokens_per_round": round(tokens / rounds, 3) if rounds else None,
        "tokens_per_s": round(tokens / max(gen_s + prefill_s, 1e-9), 2),
        "ms_per_token": round(gen_s * per_token, 4),
        "split_ms_per_token": {k: round(v * per_token, 4) for k, v in parts.items()},
        # Per round: a plain round is one decode step and one token (but a last round whose
        # token is EOS): the unit llama-server's own timing is per.
        "ms_per_round": round(gen_s * per_round, 4),
        "split_ms_per_round": {k: round(v * per_round, 4) for k, v in parts.items()},
        "engine_detail_ms_per_token": {k: round(v * per_token, 4) for k, v in detail.items()},
        # Everything but the model's own step: what this process adds to each token.
        "own_ms_per_token": round(own * per_token, 4),
        "own_ms_per_round": round(own * 1e3 / rounds, 4) if rounds else None,
        "prefill": {
            "tokens": fed,
            "ms_per_token": round(prefill_s * 1e3 / fed, 4) if fed else None,
            "model_ms_per_token": round(prefill_model * 1e3 / fed, 4) if fed else None,
        },
    }


def timed_generate(
    rt: Runtime,
    prompt: list[int],
    params: SamplingParams,
    draft: str = "none",
    k: int | None = None,
    on_token: TokenCallback | None = None,
    policy: str | None = None,
) -> Timed:
    """One generation from an empty KV cache (each pays its prefill), with the target's
    decode time around it."""
    rt.target.reset()
    d0, f0 = rt.target.decode_s, rt.target.forward_s
    gen = rt.generate(prompt, params, draft=draft, k=k, on_token=on_token, policy=policy)
    return Timed(gen, rt.target.decode_s - d0, rt.target.forward_s - f0)


# --- streaming as the daemon does it -----------------------------------------------------------


class StreamSink:
    """The daemon's streaming path without the socket: the engine thread posts each text delta
    as its worker does (GenerateJob.post: an event loop wake-up per delta), and an event loop on
    a thread of its own turns each one into an SSE chunk (openai_api.sse) as a stream does."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.chunks = 0

    def open(self) -> tuple[TokenCallback, Callable[[Generation], None]]:
        """(on_token for one generation, finish(gen) that waits for its stream to drain)."""
        from memspec.request_check import ClientRequest
        from memspec.server.openai_api import sse
        from memspec.server.worker import Done, GenerateJob, Token

        job = GenerateJob(self.loop, ClientRequest(prompt=""), stream=True)

        async def drain() -> None:
            while True:
                ev = await job.next_event()
                if isinstance(ev, Done):
                    return
                sse(
                    {
                        "object": "chat.completion.chunk",
                        "choices": [{"delta": {"content": ev.text}}],
                    }
                )
                self.chunks += 1

        done = asyncio.run_coroutine_threadsafe(drain(), self.loop)

        def on_token(delta: str, _token: int | None) -> None:
            if delta:  # what the worker's on_token does for a stream
                job.post(Token(delta, None))

        def finish(gen: Generation) -> None:
            job.post(Done(gen))
            done.result(timeout=60)

        return on_token, finish

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


# --- part 1: the real target -------------------------------------------------------------


def _tokens(rt: Runtime, p: BenchPrompt) -> list[int]:
    if p.chat:
        return rt.requests.prompt_tokens(messages=[{"role": "user", "content": p.text}])
    return rt.requests.prompt_tokens(prompt=p.text)


def run_real(
    settings: Settings,
    prompts: list[BenchPrompt],
    params: SamplingParams,
    stream: bool = True,
    peer_server: bool = True,
    repeat: int = 1,
) -> dict[str, Any]:
    """Part 1: plain decoding of `prompts` by memspec (and with streaming, and llama-server),
    `repeat` times over, the systems' order alternating from one prompt to the next."""
    settings = settings.model_copy(update={"drafts": []})  # plain decoding: no draft loaded
    rt = Runtime(settings, calibrate_costs=False)
    sink = StreamSink() if stream else None
    server, skipped = _peer(settings, peer_server)
    rows: dict[str, list[dict[str, Any]]] = {"memspec": []}
    if sink is not None:
        rows["memspec stream"] = []
    peer_rows: list[dict[str, Any]] = []
    try:
        warm = rt.requests.prompt_tokens(
            messages=[{"role": "user", "content": "Say hello in one line."}]
        )
        timed_generate(rt, warm, SamplingParams(max_tokens=16))
        for n, p in enumerate(prompts * max(repeat, 1)):
            prompt = _tokens(rt, p)
            order = list(rows) + (["llama-server"] if server is not None else [])
            if n % 2:  # alternate, so that machine noise hits every system alike
                order.reverse()
            for name in order:
                if name == "llama-server":
                    assert server is not None
                    row = _peer_row(server, prompt, params.max_tokens, rt.target.eos_token_ids)
                    peer_rows.append({"id": p.id, **row})
                    continue
                if name == "memspec stream":
                    assert sink is not None
                    on_token, finish = sink.open()
                    timed = timed_generate(rt, prompt, params, on_token=on_token)
                    finish(timed.gen)
                else:
                    timed = timed_generate(rt, prompt, params)
                rows[name].append(timed.row(p.id))
    finally:
        if sink is not None:
            sink.close()
        if server is not None:
            server.close()
        rt.close()
    plain = {r["id"]: r["token_ids"] for r in rows["memspec"]}
    systems: dict[str, Any] = {}
    for name, rs in rows.items():
        systems[name] = {
            **split(rs),
            "identical_to_plain": all(r["token_ids"] == plain[r["id"]] for r in rs),
            "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rs],
        }
    report: dict[str, Any] = {"systems": systems, "peer_server_skipped": skipped}
    if peer_rows:
        systems["llama-server"] = _peer_summary(peer_rows, plain)
        report["memspec_vs_llama_server"] = _versus(rows["memspec"], peer_rows)
    return report


def _versus(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """memspec's plain decoding against llama-server's, as speed ratios (above 1: memspec is
    faster): over the whole run, and the median of the per-prompt ratios (each pair ran back
    to back, so a burst of load on the shared box moves one pair, not the median)."""
    mine, peer = split(ours), _peer_summary(theirs, {})

    def step(r: dict[str, Any], their: dict[str, Any]) -> float:
        their_ms = their["predicted_ms"] / max(their["predicted_n"] - 1, 1)
        return their_ms / split([r])["ms_per_round"]

    def prompt(r: dict[str, Any], their: dict[str, Any]) -> float | None:
        ms = split([r])["prefill"]["ms_per_token"]
        return their["prompt_ms"] / their["prompt_n"] / ms if ms and their["prompt_n"] else None

    pairs = list(zip(ours, theirs, strict=True))
    steps = [step(a, b) for a, b in pairs]
    prompts = [x for x in (prompt(a, b) for a, b in pairs) if x is not None]
    return {
        "tokens_per_s": round(mine["tokens_per_s"] / peer["tokens_per_s"], 3),
        "decode_step": round(peer["ms_per_round"] / mine["ms_per_round"], 3),
        "prompt_token": round(peer["prefill"]["ms_per_token"] / mine["prefill"]["ms_per_token"], 3)
        if peer["prefill"]["ms_per_token"] and mine["prefill"]["ms_per_token"]
        else None,
        "decode_step_median_of_prompts": round(statistics.median(steps), 3),
        "prompt_token_median_of_prompts": round(statistics.median(prompts), 3) if prompts else None,
        # How far the medians can be trusted on a noisy box: a ratio whose interval holds 1.0
        # is no measured difference.
        "decode_step_median_ci95": median_ci95(steps),
        "prompt_token_median_ci95": median_ci95(prompts) if prompts else None,
        "pairs": len(pairs),
    }


def median_ci95(values: list[float], resamples: int = 2000) -> list[float]:
    """A 95% bootstrap interval of the median of `values` (seeded: the same run, the same
    interval)."""
    x = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, len(x), (resamples, len(x)))
    medians = np.median(x[picks], axis=1)
    return [round(float(v), 3) for v in np.percentile(medians, [2.5, 97.5])]


def _peer(settings: Settings, wanted: bool) -> tuple[PeerServer | None, str]:
    if not wanted:
        return None, "not asked for (--no-peer-server)"
    binary = PeerServer.find()
    if binary is None:
        return None, "llama-server not built: run scripts/setup.sh --peer"
    try:
        return PeerServer(binary, settings, []), ""
    except Exception as e:  # noqa: BLE001 - a peer that will not start is reported, not fatal
        return None, f"llama-server did not start: {e}"


def _peer_row(
    server: PeerServer, prompt: list[int], max_tokens: int, eos: frozenset[int]
) -> dict[str, Any]:
    out = server.complete_json(prompt, max_tokens)
    t = out.get("timings", {})
    return {
        "token_ids": generated_tokens(out, eos),
        "prompt_n": int(t.get("prompt_n", 0)),
        "prompt_ms": float(t.get("prompt_ms", 0.0)),
        "predicted_n": int(t.get("predicted_n", 0)),
        "predicted_ms": float(t.get("predicted_ms", 0.0)),
    }


def _peer_summary(rows: list[dict[str, Any]], plain: dict[str, list[int]]) -> dict[str, Any]:
    """llama-server's own timings, per decode step as memspec's plain rounds are. Its first
    token comes from the prompt's pass (prompt_ms ends when it is sampled), so predicted_ms
    spans predicted_n - 1 decode steps (its own predicted_per_token_ms divides by those);
    predicted_n counts the EOS it stopped on, which memspec's tokens do not."""
    prompt_n = sum(r["prompt_n"] for r in rows)
    prompt_ms = sum(r["prompt_ms"] for r in rows)
    predicted_ms = sum(r["predicted_ms"] for r in rows)
    steps = sum(max(r["predicted_n"] - 1, 0) for r in rows)
    tokens = sum(len(r["token_ids"]) for r in rows)
    return {
        "tokens": tokens,
        "rounds": steps,
        "tokens_per_s": round(tokens / max((prompt_ms + predicted_ms) / 1e3, 1e-9), 2),
        "ms_per_round": round(predicted_ms / max(steps, 1), 4),
        "prefill": {
            "tokens": prompt_n,
            "ms_per_token": round(prompt_ms / prompt_n, 4) if prompt_n else None,
        },
        "identical_to_plain": all(r["token_ids"] == plain.get(r["id"]) for r in rows),
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
    }


# --- part 2: the stub target -------------------------------------------------------------


# (name, draft, k, temperature): plain and prompt-lookup rounds, greedy and sampled; then the
# daemon's own choice (policy memspec, draft auto) among every free draft of the target's
# pool, each peeked every round, as a daemon with its datastores resident does.
POOL_CONFIG = "policy, free pool greedy"
STUB_CONFIGS: list[tuple[str, str, int | None, float]] = [
    ("plain greedy", "none", None, 0.0),
    ("plain sampled", "none", None, 1.0),
    ("prompt-lookup k=4 greedy", "prompt-lookup", 4, 0.0),
    ("prompt-lookup adaptive-k greedy", "prompt-lookup", None, 0.0),
    ("prompt-lookup k=4 sampled", "prompt-lookup", 4, 1.0),
    (POOL_CONFIG, "auto", None, 0.0),
]


def free_pool(settings: Settings) -> list[str]:
    """The target's pool's built drafts that run no model (the registry's kinds that are not
    weighty: prompt lookup, datastores): what a stub target can be decoded beside."""
    from memspec.drafts.family import settings_pool_dir
    from memspec.drafts.manifest import load_manifests
    from memspec.drafts.registry import KINDS

    manifests = load_manifests(settings_pool_dir(settings))
    light = {name for name, kind in KINDS.items() if not kind.weighty}
    return [i for i, m in manifests.items() if m.kind in light and m.is_built(models_dir())]


def run_stub(settings: Settings, tokens: int = 512, sweep_mib: int = COLD_SWEEP_MIB) -> dict:
    """Part 2: the runtime's own cost per token and per round over StubBackend, warm and cold."""
    path = resolve_model_path(settings.target)
    shape = read_shape(path)
    stub = StubBackend(path, shape.n_vocab, settings.n_ctx)
    # The free drafts preloaded, and room for them: no model draft is named, so none is loaded.
    free = free_pool(settings)
    budget = target_footprint(path, settings.n_ctx, settings.k_max).total + (1 << 30)
    stub_settings = settings.model_copy(update={"drafts": free, "budget": budget})
    rt = Runtime(stub_settings, calibrate_costs=False, target=stub)
    try:
        prompt = [1] + stub.cycle * 3
        n = max(min(tokens, stub.n_ctx - len(prompt) - 1), 1)
        out: dict[str, Any] = {
            "vocab": shape.n_vocab,
            "prompt_tokens": len(prompt),
            "free_pool": sorted(rt.drafts),
        }
        for mode, sweep in (("warm", 0), ("cold", sweep_mib)):
            stub.sweep_mib = sweep
            results: dict[str, Any] = {}
            for name, draft, k, temperature in STUB_CONFIGS:
                params = SamplingParams(max_tokens=n, temperature=temperature, seed=0)
                timed_generate(rt, prompt, SamplingParams(max_tokens=16), draft, k)  # warm-up
                row = timed_generate(rt, prompt, params, draft, k).row(name)
                s = split([row])
                # Greedy walks the cycle on; the lookup's proposals are then always right.
                s["continues_cycle"] = row["token_ids"][:2] == stub.cycle[:2]
                results[name] = s
            out[mode] = {"sweep_mib": sweep, "configs": results}
    finally:
        rt.close()
    out["goal_ms"] = OWN_COST_GOAL_MS
    return out


# --- the command -------------------------------------------------------------------------


def run_runtime_bench(
    settings: Settings,
    out: str,
    plot: str | None = None,
    workload: str = "heldout",
    prompts: int = 3,
    max_tokens: int = 128,
    stream: bool = True,
    peer_server: bool = True,
    real: bool = True,
    stub: bool = True,
    stub_tokens: int = 512,
    sweep_mib: int = COLD_SWEEP_MIB,
    repeat: int = 1,
) -> dict[str, Any]:
    """Both parts, one JSON report (and table on stderr, plot if asked)."""
    report: dict[str, Any] = {
        "benchmark": "runtime",
        "target": settings.target,
        "max_tokens": max_tokens,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
    }
    with tempfile.TemporaryDirectory() as state:
        # The bench's runtimes keep what they learn to themselves: a plain-only runtime saving
        # its (empty) working set would steer the next daemon's warm start.
        settings = settings.model_copy(update={"state_dir": Path(state)})
        if real:
            chosen = pick_prompts(workload, prompts)
            report["workload"] = {"name": workload, "prompts": [p.id for p in chosen]}
            params = SamplingParams(max_tokens=max_tokens)
            report["real"] = run_real(settings, chosen, params, stream, peer_server, repeat)
        if stub:
            report["stub"] = run_stub(settings, stub_tokens, sweep_mib)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)
    if plot:
        plot_report(report, plot)
    return report


def pick_prompts(workload: str, n: int) -> list[BenchPrompt]:
    """`n` prompts of the workload, taken round-robin over its categories (code and chats)."""
    everything = load_workload(workload, per_category=n)
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in everything:
        by_cat.setdefault(p.category, []).append(p)
    chosen: list[BenchPrompt] = []
    while len(chosen) < n and any(by_cat.values()):
        for cat in list(by_cat):
            if by_cat[cat] and len(chosen) < n:
                chosen.append(by_cat[cat].pop(0))
    return chosen


def print_tables(report: dict[str, Any]) -> None:
    err = sys.stderr
    real = report.get("real")
    if real:
        print("\nplain decoding, ms per decode step (prefill: per prompt token)", file=err)
        head = " ".join(f"{p:>10s}" for p in SPLIT)
        print(f"{'system':16s} {'tok/s':>7s} {'total':>7s} {head} {'prefill':>8s}", file=err)
        for name, s in real["systems"].items():
            cells = " ".join(
                f"{s['split_ms_per_round'][p]:10.3f}" if "split_ms_per_round" in s else f"{'':10s}"
                for p in SPLIT
            )
            prefill = s["prefill"]["ms_per_token"]
            same = "" if s["identical_to_plain"] else "  (output differs!)"
            print(
                f"{name:16s} {s['tokens_per_s']:7.2f} {s['ms_per_round']:7.3f} {cells} "
                f"{prefill if prefill is not None else float('nan'):8.3f}{same}",
                file=err,
            )
        vs = real.get("memspec_vs_llama_server")
        if vs:
            print(
                f"memspec / llama-server speed: tokens/s {vs['tokens_per_s']}, decode step "
                f"{vs['decode_step']} (median of {vs['pairs']} prompts "
                f"{vs['decode_step_median_of_prompts']}, 95% {vs['decode_step_median_ci95']}), "
                f"prompt token {vs['prompt_token']} (median "
                f"{vs['prompt_token_median_of_prompts']}, 95% {vs['prompt_token_median_ci95']})",
                file=err,
            )
        if real["peer_server_skipped"]:
            print(f"llama-server: {real['peer_server_skipped']}", file=err)
    stub = report.get("stub")
    if stub:
        goal = stub["goal_ms"]
        print(f"\nruntime's own cost over a stub target (goal {goal} ms), ms", file=err)
        print(
            f"{'config':34s} {'mode':5s} {'/token':>8s} {'/round':>8s} {'tok/round':>9s}", file=err
        )
        for mode in ("warm", "cold"):
            for name, s in stub[mode]["configs"].items():
                print(
                    f"{name:34s} {mode:5s} {s['own_ms_per_token']:8.4f} "
                    f"{s['own_ms_per_round']:8.4f} {s['tokens_per_round']:9.2f}",
                    file=err,
                )


def plot_report(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (["real", "own"] if "real" in report else []) + (["stub"] if "stub" in report else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel in ("real", "own"):
            systems = report["real"]["systems"]
            # The whole token beside llama-server's; then memspec's own parts, zoomed in.
            names = (
                list(systems) if panel == "real" else [n for n in systems if n != "llama-server"]
            )
            parts = SPLIT if panel == "real" else SPLIT[1:]
            left = np.zeros(len(names))
            for part in parts:
                vals = np.array(
                    [systems[n].get("split_ms_per_round", {}).get(part, 0.0) for n in names]
                )
                ax.barh(names, vals, left=left, label=part, color=f"C{SPLIT.index(part)}")
                left += vals
            if panel == "real":
                peer = [systems[n]["ms_per_round"] if n == "llama-server" else 0.0 for n in names]
                ax.barh(names, peer, left=left, label="llama-server (its own timing)", color="C7")
                ax.set_title(f"plain decoding, {report['target']}")
            else:
                ax.set_title("memspec's own parts (the model's left out)")
            ax.set_xlabel("ms per decode step (plain: one token)")
            ax.legend(fontsize=7)
        else:
            stub = report["stub"]
            names = list(stub["warm"]["configs"])
            y = np.arange(len(names))
            for i, mode in enumerate(("warm", "cold")):
                vals = [stub[mode]["configs"][n]["own_ms_per_round"] for n in names]
                ax.barh(y + i * 0.4, vals, 0.4, label=f"{mode} (per round)")
            ax.axvline(stub["goal_ms"], color="k", lw=0.8, ls="--", label="goal")
            ax.set_yticks(y + 0.2, names, fontsize=7)
            ax.set_xlabel("runtime's own ms per round (plain: per token)")
            ax.set_title(f"stub target, vocabulary {stub['vocab']}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
