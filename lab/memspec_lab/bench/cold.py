"""`memspec bench cold`: the first request of a fresh runtime, plain vs the default policy.

What a user of `memspec generate --draft auto` gets: every generation starts from a new
Runtime (target loaded, calibration read from its cache, only `settings.drafts` resident, no
statistics learnt), so any draft the policy wants it must load while this one request decodes.
Per prompt, each config gets its own fresh Runtime, in an order that alternates from prompt to
prompt (machine noise hits all alike); speedups are ratios to plain decoding from this run.
`memspec bench engine` is the warm counterpart (one runtime, drafts resident, warmed up).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from memspec.config import Settings
from memspec.engine.types import SamplingParams
from memspec.runtime import Runtime
from memspec_lab.bench.engine import generation_row, print_speedup_table, speedup_summary
from memspec_lab.bench.workloads import BenchPrompt, load_workload

# (name, policy): `memspec` is the default policy, `auto` the bare decision rule.
CONFIGS = [("none", None), ("memspec", "memspec"), ("auto", "auto")]


def run_cold_bench(
    settings: Settings,
    out: str,
    per_category: int = 1,
    max_tokens: int = 128,
    workload: str = "both",
    categories: list[str] | None = None,
) -> dict:
    workloads = ["mtbench", "heldout"] if workload == "both" else [workload]
    prompts = {w: load_workload(w, per_category, categories) for w in workloads}
    params = SamplingParams(max_tokens=max_tokens)
    results: dict[str, dict[str, list[dict]]] = {w: defaultdict(list) for w in workloads}
    n = 0
    for w in workloads:
        for p in tqdm(prompts[w], desc=f"bench cold ({w})", unit="prompt"):
            order = CONFIGS[n % len(CONFIGS) :] + CONFIGS[: n % len(CONFIGS)]
            n += 1
            rows = {name: _run_fresh(settings, p, params, policy) for name, policy in order}
            plain_ids = rows["none"].pop("token_ids")
            for name, row in rows.items():
                if name != "none":
                    row["identical"] = row.pop("token_ids") == plain_ids
                results[w][name].append(row)

    report: dict = {
        "benchmark": "cold",
        "target": settings.target,
        "drafts_preloaded": settings.drafts,  # None: the target's whole family
        "max_tokens": max_tokens,
        "per_category": per_category,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "workloads": {},
    }
    for w in workloads:
        cats = sorted({p.category for p in prompts[w]})
        section: dict = {"prompts": len(prompts[w]), "categories": cats, "configs": {}}
        plain = results[w]["none"]
        for name, rows in results[w].items():
            section["configs"][name] = {
                "overall": speedup_summary(rows, plain),
                "per_category": {
                    c: speedup_summary(
                        [r for r in rows if r["category"] == c],
                        [r for r in plain if r["category"] == c],
                    )
                    for c in cats
                },
                "runs": rows,
            }
        section["all_identical"] = all(
            e["overall"]["identical_to_plain"] for e in section["configs"].values()
        )
        report["workloads"][w] = section
    report["all_identical"] = all(s["all_identical"] for s in report["workloads"].values())
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    for w, section in report["workloads"].items():
        print_speedup_table(f"{w}, cold", section)
    return report


def _run_fresh(
    settings: Settings, p: BenchPrompt, params: SamplingParams, policy: str | None
) -> dict:
    """One generation on a Runtime built for it alone, closed after."""
    rt = Runtime(settings.model_copy(deep=True))
    try:
        if p.chat:
            prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": p.text}])
        else:
            prompt = rt.requests.prompt_tokens(prompt=p.text)
        draft = "none" if policy is None else "auto"
        gen = rt.generate(prompt, params, draft=draft, policy=policy)
        loaded = [r["id"] for r in rt.draft_admin.draft_status() if r["resident"] and r["bytes"]]
    finally:
        rt.close()
    return {
        "id": p.id,
        "category": p.category,
        **generation_row(gen),
        "resident_at_end": loaded,  # what the policy loaded while this request decoded
        "token_ids": gen.token_ids,
        "identical": True,  # plain decoding is its own reference
    }
