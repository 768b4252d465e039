"""`memspec bench rpc`: plain vs speculative decoding over a target split across ggml RPC
workers, at several link latencies (SpecMemo's distributed half).

Each target step crosses the link once per device it passes; a verification of k + 1 tokens
crosses it the same number of times. So the more a step costs in latency, the more a round
that accepts several tokens is worth. Workers run on this machine (memspec_lab/rpc_local.py), each
behind a relay adding the latency each way; drafts stay local. Every output is compared with
the local target's own plain decoding. Per latency, configs run interleaved prompt by prompt."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memspec.config import Settings
from memspec.engine.types import SamplingParams
from memspec.runtime import Runtime
from memspec_lab.bench.engine import generation_row, round_profile
from memspec_lab.bench.workloads import BenchPrompt, load_workload
from memspec_lab.rpc_local import local_workers

# (name, draft, k, policy): plain, the default policy, and two fixed drafts. The model draft
# is q8_0: over a split target a target step is dear, so acceptance matters more than a
# draft step's cost (q4_0 accepted 36 of 77 on a held-out chat where q8_0 accepted 44 of 53).
CONFIGS: list[tuple[str, str, int | None, str | None]] = [
    ("none", "none", None, None),
    ("memspec", "auto", None, "memspec"),
    ("prompt-lookup adaptive-k", "prompt-lookup", None, None),
    ("q8_0 adaptive-k", "q8_0", None, None),
]


def _tokens(rt: Runtime, p: BenchPrompt) -> list[int]:
    if p.chat:
        return rt.requests.prompt_tokens(messages=[{"role": "user", "content": p.text}])
    return rt.requests.prompt_tokens(prompt=p.text)


def run_rpc_bench(
    settings: Settings,
    latencies_ms: list[float],
    n_workers: int = 2,
    per_category: int = 1,
    max_tokens: int = 64,
    workload: str = "heldout",
    worker_threads: int = 1,
) -> dict[str, Any]:
    prompts = load_workload(workload, per_category, None)
    params = SamplingParams(max_tokens=max_tokens)
    settings = settings.model_copy(update={"drafts": [c[1] for c in CONFIGS[2:]]})
    local = Runtime(settings, calibrate_costs=False)
    try:
        refs = [local.generate(_tokens(local, p), params, draft="none").token_ids for p in prompts]
    finally:
        local.close()
    report: dict[str, Any] = {
        "benchmark": "rpc",
        "target": settings.target,
        "workers": n_workers,
        "worker_threads": worker_threads,
        "link": None,  # which ran: namespaces over veth pairs, or loopback (rpc_local.py)
        "workload": workload,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "latencies_ms": latencies_ms,
        "levels": {},
    }
    for latency in latencies_ms:
        with (
            tempfile.TemporaryDirectory(prefix="memspec-rpc-bench-") as logs,
            local_workers(Path(logs), n_workers, latency / 1e3, worker_threads) as (workers, link),
        ):
            report["link"] = link
            split = settings.model_copy(update={"rpc": [w.endpoint for w in workers]})
            t0 = time.perf_counter()
            rt = Runtime(split)  # calibrated over the link: the rule sees what a pass costs
            load_s = time.perf_counter() - t0
            try:
                report["levels"][str(latency)] = _run_level(rt, prompts, refs, params, load_s)
            finally:
                rt.close()
    _summarise(report)
    return report


def _run_level(
    rt: Runtime,
    prompts: list[BenchPrompt],
    refs: list[list[int]],
    params: SamplingParams,
    load_s: float,
) -> dict[str, Any]:
    warm = rt.requests.prompt_tokens(
        messages=[{"role": "user", "content": "Say hello in one line."}]
    )
    for _, draft, k, policy in CONFIGS:
        rt.generate(warm, SamplingParams(max_tokens=8), draft=draft, k=k, policy=policy)
    rows: dict[str, list[dict]] = {name: [] for name, *_ in CONFIGS}
    # Each rule-driven config learns on its own (memspec keeps its policy's own statistics).
    estimators = {name: rt.new_estimator() for name, *_ in CONFIGS}
    for p, ref in tqdm(list(zip(prompts, refs, strict=True)), desc="bench rpc", unit="prompt"):
        tokens = _tokens(rt, p)
        for name, draft, k, policy in CONFIGS:
            rt.target.reset()  # each config pays its prefill
            est = None if policy == "memspec" else estimators[name]
            gen = rt.generate(tokens, params, draft=draft, k=k, policy=policy, estimator=est)
            rows[name].append(
                {"id": p.id, **generation_row(gen), "identical": gen.token_ids == ref}
            )
    return {
        "load_s": round(load_s, 2),
        "verify_ms": [round(s * 1e3, 2) for s in rt.costs.verify_s],
        "draft_ms_per_token": {d: round(s * 1e3, 2) for d, s in rt.costs.draft_s.items()},
        "devices": rt.devices(),
        "runs": rows,
        "round_profile": {
            name: round_profile(rows[name], rt.costs, draft) for name, draft, *_ in CONFIGS
        },
    }


def _summarise(report: dict[str, Any]) -> None:
    summary: dict[str, dict[str, Any]] = {}
    for latency, level in report["levels"].items():
        cells: dict[str, Any] = {}
        for name, rows in level["runs"].items():
            tokens = sum(r["tokens"] for r in rows)
            seconds = sum(r["seconds"] for r in rows)
            cells[name] = {
                "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
                "tokens_per_round": round(tokens / max(1, sum(r["rounds"] for r in rows)), 2),
                "identical": all(r["identical"] for r in rows),
            }
        plain = cells["none"]["tokens_per_s"] or 1.0
        for c in cells.values():
            c["speedup"] = round(c["tokens_per_s"] / plain, 3)
        summary[latency] = cells
    report["summary"] = summary
    report["all_identical"] = all(
        c["identical"] for cells in summary.values() for c in cells.values()
    )


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = [float(x) for x in report["summary"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, *_ in CONFIGS:
        tps = [report["summary"][k][name]["tokens_per_s"] for k in report["summary"]]
        a.plot(lat, tps, marker="o", label=name)
        if name != "none":
            up = [report["summary"][k][name]["speedup"] for k in report["summary"]]
            b.plot(lat, up, marker="o", label=name)
    a.set(xlabel="added one-way latency per link (ms)", ylabel="tokens/s", title="split target")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set(xlabel="added one-way latency per link (ms)", ylabel="speedup over plain",
          title="speculation over distributed plain decoding")  # fmt: skip
    for ax in (a, b):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
