"""`memspec bench engine`: MT-Bench first turns, greedy, plain vs each draft vs adaptive.

Every configuration decodes the same prompts in the same run (interleaved per prompt, so
machine noise hits all alike); speedups are ratios to plain decoding from this run only.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from memspec.config import Settings
from memspec.engine.sampling import SamplingParams
from memspec.runtime import Runtime, resolve_model_path
from memspec.testbed import load_mtbench

PEER = "llama-cpp-python prompt-lookup"


def select_questions(per_category: int, categories: list[str] | None) -> list[dict]:
    counts: dict[str, int] = defaultdict(int)
    chosen = []
    for q in load_mtbench():
        if categories and q["category"] not in categories:
            continue
        if counts[q["category"]] < per_category:
            counts[q["category"]] += 1
            chosen.append(q)
    return chosen


class PeerPromptLookup:
    """llama-cpp-python's own speculative path, on the same target file, for comparison."""

    def __init__(self, settings: Settings, k: int):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.llm = llama_cpp.Llama(
            model_path=str(resolve_model_path(settings.target)),
            n_ctx=settings.n_ctx,
            n_threads=settings.n_threads,
            n_threads_batch=settings.n_threads,
            use_mmap=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k),
            verbose=False,
        )

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        self.llm.reset()
        t = time.perf_counter()
        out: list[int] = []
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if tok == self.llm.token_eos() or len(out) >= max_tokens:
                break
            out.append(tok)
            if len(out) >= max_tokens:
                break
        return out, time.perf_counter() - t

    def close(self) -> None:
        self.llm.close()


def _summary(rows: list[dict], plain_rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    plain_tps = sum(r["tokens"] for r in plain_rows) / max(
        sum(r["seconds"] for r in plain_rows), 1e-9
    )
    proposed = sum(r.get("proposed", 0) for r in rows)
    accepted = sum(r.get("accepted", 0) for r in rows)
    rounds = sum(r.get("rounds", 0) for r in rows)
    draft_rounds = sum(r.get("draft_rounds", 0) for r in rows)
    forward = sum(r.get("forward_s", 0.0) for r in rows)
    tps = tokens / max(secs, 1e-9)
    return {
        "tokens_per_s": round(tps, 2),
        "speedup": round(tps / plain_tps, 3),
        "acceptance": round(accepted / proposed, 4) if proposed else None,
        "mean_accepted_length": round(accepted / draft_rounds, 3) if draft_rounds else None,
        "tokens_per_round": round(tokens / rounds, 3) if rounds else None,
        "identical_to_plain": all(r["identical"] for r in rows),
        "engine_overhead_share": round(1 - forward / secs, 4) if forward else None,
        "prompts": len(rows),
    }


def run_engine_bench(
    settings: Settings,
    out: str,
    plot: str | None = None,
    per_category: int = 10,
    max_tokens: int = 96,
    k_fixed: int = 4,
    categories: list[str] | None = None,
) -> dict:
    questions = select_questions(per_category, categories)
    pool = ["prompt-lookup", "q8_0", "q4_0", "q2_k"]
    settings.drafts = [d for d in settings.drafts if d not in pool] + pool
    rt = Runtime(settings)
    configs: list[tuple[str, str, int | None]] = [("none", "none", None)]
    for d in pool:
        configs += [(f"{d} k={k_fixed}", d, k_fixed), (f"{d} adaptive-k", d, None)]
    configs.append(("auto", "auto", None))
    estimators = {name: rt.new_estimator() for name, _, _ in configs}
    peer = PeerPromptLookup(settings, k_fixed)
    results: dict[str, list[dict]] = defaultdict(list)
    params = SamplingParams(max_tokens=max_tokens)
    try:
        for q in tqdm(questions, desc="bench engine", unit="prompt"):
            prompt = rt.prompt_tokens(messages=[{"role": "user", "content": q["turns"][0]}])
            plain_ids: list[int] = []
            for name, draft, k in configs:
                fwd0 = rt.target.forward_s + sum(
                    getattr(d, "backend", rt.target).forward_s
                    for d in rt.drafts.values()
                    if hasattr(d, "backend")
                )
                rt.target.reset()  # no KV reuse across configs: each pays its prefill
                gen = rt.generate(prompt, params, draft=draft, k=k, estimator=estimators[name])
                fwd = (
                    rt.target.forward_s
                    + sum(d.backend.forward_s for d in rt.drafts.values() if hasattr(d, "backend"))
                    - fwd0
                )
                if name == "none":
                    plain_ids = gen.token_ids
                results[name].append(
                    {
                        "question_id": q["question_id"],
                        "category": q["category"],
                        "tokens": gen.completion_tokens,
                        "seconds": gen.elapsed_s,
                        "proposed": gen.proposed,
                        "accepted": gen.accepted,
                        "rounds": gen.rounds,
                        "draft_rounds": sum(gen.drafts_used.values()),
                        "forward_s": fwd,
                        "identical": gen.token_ids == plain_ids,
                        "drafts_used": gen.drafts_used,
                    }
                )
            ids, secs = peer.generate(prompt, max_tokens)
            results[PEER].append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "tokens": len(ids),
                    "seconds": secs,
                    "identical": ids == plain_ids,
                }
            )
    finally:
        peer.close()
        rt.close()

    cats = sorted({q["category"] for q in questions})
    report: dict = {
        "benchmark": "engine",
        "target": settings.target,
        "max_tokens": max_tokens,
        "k_fixed": k_fixed,
        "per_category": per_category,
        "prompts": len(questions),
        "machine": {
            "cpu_count": __import__("os").cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "costs_ms": {
            "verify": [round(s * 1e3, 3) for s in rt.costs.verify_s],
            "draft_per_token": {k: round(v * 1e3, 3) for k, v in rt.costs.draft_s.items()},
        },
        "configs": {},
    }
    for name, rows in results.items():
        entry = {"overall": _summary(rows, results["none"]), "per_category": {}}
        for c in cats:
            entry["per_category"][c] = _summary(
                [r for r in rows if r["category"] == c],
                [r for r in results["none"] if r["category"] == c],
            )
        entry["runs"] = rows
        report["configs"][name] = entry
    report["all_identical"] = all(
        e["overall"]["identical_to_plain"] for n, e in report["configs"].items() if n != PEER
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    _print_table(report, cats)
    if plot:
        _plot(report, cats, plot)
    return report


def _print_table(report: dict, cats: list[str]) -> None:
    head = f"{'config':34s} {'overall':>8s} " + " ".join(f"{c[:8]:>8s}" for c in cats)
    print(head)
    for name, e in report["configs"].items():
        cells = " ".join(f"{e['per_category'][c]['speedup']:8.2f}" for c in cats)
        same = "" if e["overall"]["identical_to_plain"] else "  (outputs differ!)"
        print(f"{name:34s} {e['overall']['speedup']:8.2f} {cells}{same}")


def _plot(report: dict, cats: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(report["configs"])
    x = np.arange(len(cats) + 1)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(14, 5))
    for i, n in enumerate(names):
        e = report["configs"][n]
        vals = [e["per_category"][c]["speedup"] for c in cats] + [e["overall"]["speedup"]]
        ax.bar(x + i * width, vals, width, label=n)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + 0.4 - width / 2, cats + ["overall"], rotation=20)
    ax.set_ylabel("speedup over plain decoding (same run)")
    ax.set_title(
        f"memspec bench engine — {report['prompts']} MT-Bench first turns, "
        f"greedy, {report['max_tokens']} tokens"
    )
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
