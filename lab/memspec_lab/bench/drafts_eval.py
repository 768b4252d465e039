"""`memspec drafts eval`: every draft of the pool against the target on MT-Bench first turns.

Per draft and category: acceptance, mean accepted tokens per drafted round, draft cost per
token (calibrated), bytes resident, tokens/s and speedup over plain decoding measured in the
same run (configurations interleaved per prompt, so machine noise hits all alike), and whether
the output is identical to plain decoding. Each draft runs under the engine's decision rule
(k chosen per round from its running α, "none" allowed), as the daemon would use it alone,
with acceptance estimates that start from the priors for every request.

Lookup drafts (prompt lookup, datastores) are also replayed along the plain output, asked at
every position: coverage and first-token acceptance independent of the decision rule.

`--replay-only` skips the timed decoding: the target's greedy answers to every chosen question
are made in one batched pass, and every draft, model drafts included (teacher-forced: the
draft's argmax at each position of the answer; a head from the target's feature at each
position), is replayed along them. That is the cheap,
deterministic comparison of drafts' accuracy per category (domain variants against each other).

Datastore drafts do not learn from outputs during the run: every configuration decodes the
same prompt, so learning would hand later ones the answer.
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
from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
from memspec.engine.sampling import SamplingParams
from memspec.paths import models_dir
from memspec_lab.testbed import select_questions


def built_drafts(manifest_dir: Path | None = None) -> list[str]:
    """Ids of the pool whose files exist (lookup drafts always do)."""
    ids = []
    for m in load_manifests(manifest_dir or DEFAULT_MANIFEST_DIR).values():
        if m.file is None or m.model_path(models_dir()).is_file():
            ids.append(m.id)
    return ids


def replay_lookup(draft, prompt: list[int], output: list[int], k: int = 8) -> dict[str, int]:
    """A lookup draft asked at every position of the target's output (no target calls).

    Independent of the decision rule: how often the draft has something to propose
    (`positions_proposed`), how often its first token is right, and the accepted run.
    """
    stats = {"positions": 0, "positions_proposed": 0, "first_ok": 0, "proposed": 0, "accepted": 0}
    params = SamplingParams()
    for i in range(len(output)):
        tokens = draft.propose(prompt + output[:i], k, params, None).tokens
        run = 0
        while run < len(tokens) and i + run < len(output) and tokens[run] == output[i + run]:
            run += 1
        stats["positions"] += 1
        stats["positions_proposed"] += bool(tokens)
        stats["first_ok"] += run > 0
        stats["proposed"] += len(tokens)
        stats["accepted"] += run
    return stats


def replay_model(draft, prompt: list[int], output: list[int]) -> dict[str, int]:
    """A model draft teacher-forced along the target's output: is its argmax the next token?"""
    be = draft.backend
    be.reset()
    logits = be.eval(prompt + output, all_logits=True)
    be.reset()
    guess = logits[len(prompt) - 1 : len(prompt) + len(output) - 1].argmax(axis=-1)
    ok = int(sum(int(g) == t for g, t in zip(guess, output, strict=True)))
    n = len(output)
    return {"positions": n, "positions_proposed": n, "first_ok": ok, "proposed": 0, "accepted": 0}


def replay_head(draft, prompt: list[int], output: list[int]) -> dict[str, int]:
    """A head asked at every position of the target's output, from the target's own feature
    there (one eval of the whole sequence gives them all): as replay_lookup."""
    target = draft.target
    target.reset()
    target.eval(prompt + output, all_logits=True, copy=False)
    try:
        return replay_lookup(draft, prompt, output)
    finally:
        target.reset()


def run_drafts_replay(
    settings: Settings,
    out: str,
    per_category: int = 10,
    max_tokens: int = 96,
    categories: list[str] | None = None,
    drafts: list[str] | None = None,
) -> dict:
    """First-token acceptance of every draft along the target's greedy answers, per category."""
    from memspec.drafts.datastore import DatastoreDraft
    from memspec.drafts.head import HeadDraft
    from memspec.drafts.model import ModelDraft
    from memspec.recipes.corpus import BatchedGreedy
    from memspec.runtime import Runtime

    questions = select_questions(per_category, categories=categories)
    pool = drafts or built_drafts(settings.manifest_dir)
    settings = settings.model_copy(update={"drafts": pool})
    rt = Runtime(settings, calibrate_costs=False)
    try:
        prompts = [
            rt.requests.prompt_tokens(messages=[{"role": "user", "content": q["turns"][0]}])
            for q in questions
        ]
        target_path = Path(rt.target.path)
    finally:
        rt.close()
    # One batched greedy pass for all answers (a near-tie may resolve differently from
    # single-sequence decoding; every draft is replayed along the same answers either way).
    gen = BatchedGreedy(
        target_path,
        batch=min(48, len(questions)),
        n_ctx_per_seq=max(map(len, prompts)) + max_tokens + 8,
        n_threads=settings.n_threads or 1,
    )
    try:
        rows = [{"i": str(i), "prompt": q["turns"][0]} for i, q in enumerate(questions)]
        answers = {
            int(r["i"]): toks
            for r, toks in tqdm(
                gen.run(rows, max_tokens), total=len(rows), desc="target answers", unit="prompt"
            )
        }
        assert all(gen.chat_tokens(r["prompt"]) == prompts[int(r["i"])] for r in rows)
    finally:
        gen.close()

    rt = Runtime(settings, calibrate_costs=False)
    report: dict = {
        "benchmark": "drafts-replay",
        "target": settings.target,
        "max_tokens": max_tokens,
        "prompts": len(questions),
        "drafts": {},
    }
    try:
        for d_id in tqdm(pool, desc="replay", unit="draft"):
            draft = rt.draft_admin.load_draft(d_id)
            if isinstance(draft, DatastoreDraft):
                draft.learn = False
            rows_d = []
            for i, q in enumerate(questions):
                if isinstance(draft, ModelDraft):
                    rep = replay_model(draft, prompts[i], answers[i])
                elif isinstance(draft, HeadDraft):
                    rep = replay_head(draft, prompts[i], answers[i])
                else:
                    rep = replay_lookup(draft, prompts[i], answers[i])
                rows_d.append({"category": q["category"], "replay": rep})
            cats = sorted({q["category"] for q in questions})
            report["drafts"][d_id] = {
                "kind": rt.manifests[d_id].kind,
                "bytes": rt.draft_admin.draft_bytes(d_id),
                "overall": _replay_summary(rows_d),
                "per_category": {
                    c: _replay_summary([r for r in rows_d if r["category"] == c]) for c in cats
                },
            }
    finally:
        rt.close()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    cats = sorted({q["category"] for q in questions})
    print(f"{'draft':20s} {'MB':>7s} {'overall':>8s} " + " ".join(f"{c[:9]:>9s}" for c in cats))
    for name, e in report["drafts"].items():
        cells = " ".join(
            f"{_pct(e['per_category'][c]['first_token_acceptance']):>9s}" for c in cats
        )
        overall = _pct(e["overall"]["first_token_acceptance"])
        print(f"{name:20s} {e['bytes'] / 1e6:7.1f} {overall:>8s} {cells}")
    print("cells: first-token acceptance % along the target's greedy answers (where proposed)")
    return report


def _replay_summary(rows: list[dict]) -> dict | None:
    reps = [r["replay"] for r in rows if r.get("replay")]
    if not reps:
        return None
    tot = {key: sum(r[key] for r in reps) for key in reps[0]}
    n = max(tot["positions"], 1)
    return {
        "coverage": round(tot["positions_proposed"] / n, 4),
        "first_token_acceptance": round(tot["first_ok"] / max(tot["positions_proposed"], 1), 4),
        "accepted_per_position": round(tot["accepted"] / n, 4),
        "acceptance_k8": round(tot["accepted"] / max(tot["proposed"], 1), 4),
    }


def _summary(rows: list[dict], plain: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    p_tokens = sum(r["tokens"] for r in plain)
    p_secs = sum(r["seconds"] for r in plain)
    proposed = sum(r["proposed"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    draft_rounds = sum(r["draft_rounds"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    tps = tokens / max(secs, 1e-9)
    plain_tps = p_tokens / max(p_secs, 1e-9)
    return {
        "tokens_per_s": round(tps, 2),
        "plain_tokens_per_s": round(plain_tps, 2),
        "speedup": round(tps / plain_tps, 3) if plain_tps else None,
        "acceptance": round(accepted / proposed, 4) if proposed else None,
        "mean_accepted_per_draft_round": round(accepted / draft_rounds, 3)
        if draft_rounds
        else None,
        "draft_round_share": round(draft_rounds / rounds, 3) if rounds else None,
        "tokens_per_round": round(tokens / rounds, 3) if rounds else None,
        "proposed": proposed,
        "accepted": accepted,
        "draft_s_per_token": round(sum(r["draft_s"] for r in rows) / max(proposed, 1), 6),
        "identical_to_plain": all(r["identical"] for r in rows),
        "prompts": len(rows),
        "replay": _replay_summary(rows),
    }


def _generate(rt, prompt: list[int], params: SamplingParams, name: str):
    """One request with one draft (or none) under the decision rule, on the engine directly:
    the draft is held for the whole run, so residency management never decides for it."""
    from memspec.engine.policy import DecisionRulePolicy, FixedPolicy
    from memspec.engine.speculative import speculative_generate

    if name == "none":
        policy = FixedPolicy(None, 0)
    else:
        draft = rt.draft_admin.load_draft(name)
        policy = DecisionRulePolicy([draft], rt.costs, rt.new_estimator(), rt.settings.k_max)
    with rt.lock:
        return speculative_generate(rt.target, prompt, params, policy)


def run_drafts_eval(
    settings: Settings,
    out: str,
    plot: str | None = None,
    per_category: int = 3,
    max_tokens: int = 96,
    categories: list[str] | None = None,
    drafts: list[str] | None = None,
) -> dict:
    from memspec.drafts.datastore import DatastoreDraft
    from memspec.drafts.prompt_lookup import PromptLookupDraft
    from memspec.runtime import Runtime

    questions = select_questions(per_category, categories=categories)
    pool = drafts or built_drafts(settings.manifest_dir)
    settings = settings.model_copy(update={"drafts": pool})
    rt = Runtime(settings)
    drafts_live = {d_id: rt.draft_admin.load_draft(d_id) for d_id in pool}
    for d in drafts_live.values():
        if isinstance(d, DatastoreDraft):
            d.learn = False
    configs = ["none", *pool]
    results: dict[str, list[dict]] = defaultdict(list)
    params = SamplingParams(max_tokens=max_tokens)
    try:
        for q in tqdm(questions, desc="drafts eval", unit="prompt"):
            prompt = rt.requests.prompt_tokens(
                messages=[{"role": "user", "content": q["turns"][0]}]
            )
            plain_ids: list[int] = []
            for name in configs:
                rt.target.reset()  # no KV reuse across configurations
                # A fresh estimate per request: each starts from the priors, so one category's
                # rejections do not switch a draft off for the categories that come after it.
                gen = _generate(rt, prompt, params, name)
                if name == "none":
                    plain_ids = gen.token_ids
                results[name].append(
                    {
                        "question_id": q["question_id"],
                        "category": q["category"],
                        "tokens": gen.completion_tokens,
                        "seconds": gen.elapsed_s,
                        "draft_s": gen.draft_s,
                        "proposed": gen.proposed,
                        "accepted": gen.accepted,
                        "rounds": gen.rounds,
                        "draft_rounds": sum(gen.drafts_used.values()),
                        "identical": gen.token_ids == plain_ids,
                    }
                )
            for name in pool:  # lookup drafts: also replayed along the plain output
                draft = drafts_live[name]
                if isinstance(draft, PromptLookupDraft):
                    results[name][-1]["replay"] = replay_lookup(draft, prompt, plain_ids)
        info = {
            d_id: {
                "kind": rt.manifests[d_id].kind,
                "bytes": drafts_live[d_id].memory_bytes(),
                "file_bytes": rt.draft_admin.draft_bytes(d_id),
                "tags": rt.manifests[d_id].tags,
                "calibrated_draft_ms_per_token": round(rt.costs.draft_s.get(d_id, 0.0) * 1e3, 3),
                "calibrated_overhead_ms_per_round": round(
                    rt.costs.draft_overhead_s.get(d_id, 0.0) * 1e3, 3
                ),
            }
            for d_id in pool
        }
        verify_ms = [round(s * 1e3, 3) for s in rt.costs.verify_s]
    finally:
        rt.close()

    cats = sorted({q["category"] for q in questions})
    report: dict = {
        "benchmark": "drafts-eval",
        "target": settings.target,
        "max_tokens": max_tokens,
        "per_category": per_category,
        "prompts": len(questions),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "n_threads": settings.n_threads,
        },
        "verify_ms": verify_ms,
        "drafts": {},
    }
    for name in configs:
        rows = results[name]
        entry = {
            **(info.get(name, {"kind": "none", "bytes": 0})),
            "overall": _summary(rows, results["none"]),
            "per_category": {
                c: _summary(
                    [r for r in rows if r["category"] == c],
                    [r for r in results["none"] if r["category"] == c],
                )
                for c in cats
            },
            "runs": rows,
        }
        report["drafts"][name] = entry
    report["all_identical"] = all(
        e["overall"]["identical_to_plain"] for e in report["drafts"].values()
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    print_table(report, cats)
    if plot:
        plot_report(report, cats, plot)
    return report


def print_table(report: dict, cats: list[str]) -> None:
    print(f"{'draft':20s} {'MB':>7s} {'overall':>8s} " + " ".join(f"{c[:9]:>9s}" for c in cats))
    for name, e in report["drafts"].items():
        cells = " ".join(
            f"{e['per_category'][c]['speedup']:5.2f}/{_pct(e['per_category'][c]['acceptance'])}"
            for c in cats
        )
        same = "" if e["overall"]["identical_to_plain"] else "  (outputs differ!)"
        print(f"{name:20s} {e['bytes'] / 1e6:7.1f} {e['overall']['speedup']:8.2f} {cells}{same}")
    print("cells: speedup/acceptance% per category (same run, plain decoding = 1.00)")


def _pct(a: float | None) -> str:
    return " --" if a is None else f"{round(a * 100):3d}"


def plot_report(report: dict, cats: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n for n in report["drafts"] if n != "none"]
    x = np.arange(len(cats) + 1)
    width = 0.8 / max(len(names), 1)
    fig, axes = plt.subplots(2, 1, figsize=(14, 8), sharex=True)
    for i, n in enumerate(names):
        e = report["drafts"][n]
        sp = [e["per_category"][c]["speedup"] for c in cats] + [e["overall"]["speedup"]]
        acc = [e["per_category"][c]["acceptance"] or 0.0 for c in cats]
        acc.append(e["overall"]["acceptance"] or 0.0)
        label = f"{n} ({e['bytes'] / 1e6:.0f} MB)"
        axes[0].bar(x + i * width, sp, width, label=label)
        axes[1].bar(x + i * width, acc, width, label=label)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_ylabel("speedup over plain decoding")
    axes[1].set_ylabel("acceptance")
    axes[1].set_xticks(x + 0.4 - width / 2, cats + ["overall"], rotation=20)
    axes[0].set_title(
        f"memspec drafts eval: {report['prompts']} MT-Bench first turns, greedy, "
        f"{report['max_tokens']} tokens"
    )
    axes[0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
