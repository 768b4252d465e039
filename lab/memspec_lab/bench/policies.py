"""`memspec bench policies`: none, fixed drafts, ucb, exp3, memspec and oracle on one workload
(live runs add auto).

The workload is MT-Bench, both turns, with categories interleaved in runs (two questions of
one category, then the next category...), so what is worth keeping resident changes over
time; the budget holds the target plus fewer drafts than the pool.

- `--mode sim`: replay a trace under a device profile (`this-machine`, `jetson-orin-nano-8gb`),
  many requests, plus the SpecMemo curve: memspec's tokens/s as the budget shrinks.
- `--mode live`: the real engine on this machine. Every policy decodes every request; the
  policies take turns request by request (the order rotates), so machine noise falls on all
  alike. Policies that decide by the rule (auto, memspec) run as the daemon runs them. Each
  policy has its own working set under the same budget, and a load its prefetch left running
  when its request ended is waited for and charged to it. Greedy output must be identical to
  plain decoding for every policy and request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from memspec.paths import DEFAULT_PREDICTOR
from memspec.predictor.model import load_or_fallback
from memspec_lab.sim.profile import profile_for
from memspec_lab.sim.simulator import (
    build_setup,
    oracle_table,
    policy_for,
    resolve_budget,
    sim_workload,
    simulate,
)
from memspec_lab.sim.traces import Trace, load_trace

QUICK_CATEGORIES = ["writing", "extraction", "coding", "humanities"]
SUMMARY_KEYS = ("tokens_per_s", "stall_s", "loads", "evictions", "acceptance", "peak_bytes")


@dataclass
class BenchConfig:
    mode: str = "sim"
    budget: str = "auto"
    quick: bool = False
    trace: str | None = None
    profile: str = "this-machine"
    per_category: int = 2
    offset: int = 5
    categories: list[str] | None = None
    turns: int = 2
    max_tokens: int = 96
    sim_requests: int = 2000
    policies: list[str] | None = None
    predictor: str | None = None
    curve: bool = True
    seed: int = 0
    curve_points: int = 7
    extra: dict = field(default_factory=dict)

    def apply_quick(self) -> None:
        if not self.quick:
            return
        self.per_category = 1
        self.categories = self.categories or QUICK_CATEGORIES
        self.max_tokens = min(self.max_tokens, 32)
        self.sim_requests = min(self.sim_requests, 200)
        self.curve_points = 4


def policy_names(trace: Trace, only: list[str] | None, live: bool = False) -> list[str]:
    """The policies a run compares; live runs add `auto` (the decision rule over the drafts
    the configuration preloads: what the daemon does when no policy plans residency)."""
    fixed = [f"fixed:{d}" for d in trace.draft_ids]
    names = ["none", *fixed, *(["auto"] if live else []), "ucb", "exp3", "memspec", "oracle"]
    if only:
        unknown = [p for p in only if p not in names]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; choose from {names}")
        names = [p for p in names if p in only]
    return names


def summarise(report: dict) -> dict:
    """Best fixed draft and the ratios the goals are stated in."""
    pol = report["policies"]
    fixed = {k: v for k, v in pol.items() if k.startswith("fixed:")}
    best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"]) if fixed else None
    report["best_fixed"] = best

    def ratio(a: str | None, b: str | None) -> float | None:
        if a in pol and b in pol and pol[b]["tokens_per_s"]:
            return round(pol[a]["tokens_per_s"] / pol[b]["tokens_per_s"], 3)
        return None

    report["ratios"] = {
        "memspec/ucb": ratio("memspec", "ucb"),
        "memspec/exp3": ratio("memspec", "exp3"),
        "memspec/oracle": ratio("memspec", "oracle"),
        "memspec/auto": ratio("memspec", "auto"),
        "memspec/best_fixed": ratio("memspec", best),
        "memspec/none": ratio("memspec", "none"),
    }
    report["within_budget"] = all(v["peak_bytes"] <= report["budget_bytes"] for v in pol.values())
    return report


# --- sim ----------------------------------------------------------------------------------


def bench_sim(cfg: BenchConfig) -> dict:
    if not cfg.trace:
        raise ValueError(
            "--mode sim needs --trace FILE (collect one with `memspec traces collect`)"
        )
    trace = load_trace(cfg.trace)
    profile = profile_for(cfg.profile, trace)
    setup = build_setup(trace, profile)
    budget = resolve_budget(cfg.budget, setup)
    workload = sim_workload(trace, cfg.sim_requests, cfg.seed)
    oracle = oracle_table(trace, setup)
    predictor_path = Path(cfg.predictor) if cfg.predictor else DEFAULT_PREDICTOR
    names = policy_names(trace, cfg.policies)

    def run(name: str, budget_bytes: int) -> dict:
        pred = load_or_fallback(predictor_path) if name == "memspec" else None
        policy = policy_for(name, setup, trace, pred, oracle, cfg.seed)
        out = simulate(trace, setup, policy, budget_bytes, workload)
        if name == "memspec":
            out["predictor"] = {k: pred.describe()[k] for k in ("loaded", "path", "error")}
        return out

    report: dict = {
        "mode": "sim",
        "budget_bytes": budget,
        "profile": profile.name,
        "trace": str(cfg.trace),
        "requests": len(workload),
        "target_bytes": profile.target_bytes,
        "drafts_bytes": {d: c.bytes for d, c in setup.dcost.items()},
        "policies": {n: run(n, budget) for n in names},
    }
    summarise(report)
    if cfg.curve:
        report["specmemo_curve"] = budget_curve(setup, cfg, run, names)
    return report


def budget_curve(setup, cfg: BenchConfig, run, names: list[str]) -> dict:
    """tokens/s vs budget, from the target alone to everything resident (SpecMemo)."""
    target = setup.profile.target_bytes
    full = setup.all_drafts_bytes
    sizes = sorted({c.bytes for c in setup.dcost.values() if c.bytes})
    # Points: evenly spaced draft memory, plus exactly each single draft's size.
    budgets = {target + full * i // (cfg.curve_points - 1) for i in range(cfg.curve_points)}
    budgets |= {target + b for b in sizes}
    curve_policies = [p for p in ("memspec", "ucb", "oracle", "none") if p in names]
    points = []
    for b in sorted(budgets):
        row = {"budget_bytes": b, "drafts_share": round((b - target) / full, 4) if full else 0.0}
        for p in curve_policies:
            row[p] = run(p, b)["tokens_per_s"]
        points.append(row)
    top = points[-1].get("memspec") or 0.0
    for row in points:
        row["memspec_vs_unconstrained"] = round(row["memspec"] / top, 4) if top else None
    # The smallest budget keeping ≥ 90% of the unconstrained tokens/s.
    keep = [r for r in points if (r["memspec_vs_unconstrained"] or 0) >= 0.9]
    smallest = min(keep, key=lambda r: r["budget_bytes"]) if keep else None
    return {
        "policies": curve_policies,
        "target_bytes": target,
        "all_drafts_bytes": full,
        "points": points,
        "smallest_budget_keeping_90pct": smallest,
        # SpecMemo's measure: draft ("generation") memory given up, and the whole budget's.
        "generation_memory_saved_at_90pct": (
            round(1 - (smallest["budget_bytes"] - target) / full, 4) if smallest and full else None
        ),
        "total_budget_saved_at_90pct": (
            round(1 - smallest["budget_bytes"] / (target + full), 4) if smallest else None
        ),
    }


# --- live ---------------------------------------------------------------------------------


def bench_live(settings, cfg: BenchConfig, out: Path) -> dict:
    from memspec_lab.bench.live_policies import run_live

    return run_live(settings, cfg, out)


# --- entry --------------------------------------------------------------------------------


def run_policy_bench(settings, cfg: BenchConfig, out: Path, plot: str | None = None) -> dict:
    cfg.apply_quick()
    t = time.perf_counter()
    report = bench_sim(cfg) if cfg.mode == "sim" else bench_live(settings, cfg, out)
    report["wall_s"] = round(time.perf_counter() - t, 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    if plot:
        write_plot(report, plot)
    return report


def print_table(report: dict) -> None:
    print(f"mode {report['mode']}, budget {report['budget_bytes'] / 1e6:.0f} MB")
    print(
        f"{'policy':22s} {'tok/s':>8s} {'stall s':>8s} {'loads':>6s} {'evict':>6s} "
        f"{'accept':>7s} {'peak MB':>8s}"
    )
    for name, r in report["policies"].items():
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(
            f"{name:22s} {r['tokens_per_s']:8.2f} {r['stall_s']:8.2f} {r['loads']:6d} "
            f"{r['evictions']:6d} {acc:>7s} {r['peak_bytes'] / 1e6:8.0f}"
        )
    print("ratios:", json.dumps(report.get("ratios")), "best fixed:", report.get("best_fixed"))
    curve = report.get("specmemo_curve")
    if curve:
        print("SpecMemo curve (drafts share of memory -> memspec tok/s):")
        for p in curve["points"]:
            print(
                f"  {p['drafts_share']:.2f}  {p['budget_bytes'] / 1e6:8.0f} MB  "
                f"{p['memspec']:8.2f}  ({p['memspec_vs_unconstrained']:.3f} of everything resident)"
            )


def write_plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report.get("specmemo_curve")
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(13 if curve else 7, 4.5))
    ax = axes[0] if curve else axes
    names = list(report["policies"])
    vals = [report["policies"][n]["tokens_per_s"] for n in names]
    colors = [
        "tab:red" if n == "memspec" else "tab:gray" if n == "oracle" else "tab:blue" for n in names
    ]
    ax.bar(range(len(names)), vals, color=colors)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"policies, {report['mode']}, budget {report['budget_bytes'] / 1e6:.0f} MB")
    if curve:
        ax2 = axes[1]
        xs = [p["budget_bytes"] / 1e6 for p in curve["points"]]
        for p in curve["policies"]:
            ax2.plot(xs, [pt[p] for pt in curve["points"]], marker="o", label=p)
        ax2.axvline(curve["target_bytes"] / 1e6, color="k", lw=0.6, ls=":")
        ax2.set_xlabel("budget (MB): target + resident drafts")
        ax2.set_ylabel("tokens/s")
        ax2.set_title("SpecMemo: tokens/s vs memory budget")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
