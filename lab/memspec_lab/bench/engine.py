"""`memspec bench engine`: greedy decoding, plain vs each draft vs adaptive, on a workload.

Workloads (memspec_lab/bench/workloads.py): MT-Bench first turns, and `heldout` (HumanEval code
completions and hand-written chats) that nothing here is tuned on; `both` runs the two and
reports them apart. `edit` (memspec_lab/bench/edit_workload.py): whole Python files of 1k-8k
tokens with an edit to make and the whole file to return, the held-out part (`edit-tuning`:
the part tuning may read); the context is sized to them. Every configuration decodes the same
prompts in the same run (interleaved per prompt, so machine noise hits all alike); speedups
are ratios to plain decoding from this run only, and rates count prompt processing and
decoding (`tokens_per_s`, per prompt too; `prefill_s` is the prompt's share). Each config also
reports where its rounds' time went and, for one-draft configs, the rate the decision rule
predicts from its costs and the measured acceptance, beside the rate measured. `lossless`:
every config of memspec's gave plain decoding's tokens. `ceiling`: the speedup a free draft
that is always right would give at its best k on the calibrated verify curve (decoding alone,
and per workload with plain's prompt processing added); for an edit workload also on the curve
measured at its prompts' context (`ceiling_at_context`: a long context makes every verified
row dearer, so the calibrated ceiling is an upper bound there).

Peers in the same run: llama-cpp-python's prompt-lookup decoding, and llama.cpp's own
`llama-server` (plain, n-gram speculation, a q4_0 draft model, both) when
`scripts/setup.sh --peer` has built it (else skipped with the reason in the report).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from memspec.config import Settings
from memspec.drafts.manifest import DraftManifest
from memspec.engine.calibration import measure_verify
from memspec.engine.costs import expected_tokens
from memspec.engine.speculative import ROUND_PHASES
from memspec.engine.types import SamplingParams
from memspec.paths import models_dir, resolve_model_path
from memspec.runtime import Runtime
from memspec.scheduler.draft_choice import DraftAsk
from memspec_lab.bench.edit_workload import (
    EDIT_WORKLOADS,
    EditPrompt,
    fit_context,
    load_edit_workload,
    with_project_context,
)
from memspec_lab.bench.peer_server import PeerServer, peer_configs
from memspec_lab.bench.workloads import BenchPrompt, load_workload

PEER = "llama-cpp-python prompt-lookup"
# The one-draft configs: the family's siblings and those of POOL that are built and speak the
# target's tokenizer. A sibling, else the first model draft of PEER_DRAFTS, is llama-server's -md.
POOL = ["prompt-lookup", "q8_0", "q4_0", "q2_k"]
PEER_DRAFTS = ["q4_0", "q2_k", "q8_0"]


def family_siblings(settings: Settings) -> list[str]:
    """The sibling drafts of the target's family (memspec.drafts.family): one-draft configs,
    and the first is llama-server's -md (the pair llama.cpp's own examples use)."""
    from memspec.drafts.family import settings_pool_dir
    from memspec.drafts.manifest import load_manifests

    return [
        i for i, m in load_manifests(settings_pool_dir(settings)).items() if "sibling" in m.tags
    ]


def open_bench_runtime(settings: Settings) -> tuple[Runtime, list[str], str | None]:
    """A runtime with the family's siblings and POOL added to `settings.drafts`: (runtime,
    the one-draft ids it can use, llama-server's -md: a sibling, else a model of PEER_DRAFTS)."""
    siblings = family_siblings(settings)
    ones = siblings + POOL
    settings = settings.model_copy(
        update={"drafts": [d for d in settings.drafts or [] if d not in ones] + ones}
    )
    rt = Runtime(settings)
    pool = [d for d in ones if d in rt.manifests and d not in rt.draft_admin.incompatible]
    peer_draft = next((d for d in siblings + PEER_DRAFTS if d in pool), None)
    return rt, pool, peer_draft


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


def generation_row(gen) -> dict:
    """What every bench records of one generation (a Generation) to summarise and profile it."""
    return {
        "tokens": gen.completion_tokens,
        "seconds": gen.elapsed_s,
        "proposed": gen.proposed,
        "accepted": gen.accepted,
        "rounds": gen.rounds,
        "draft_rounds": sum(gen.drafts_used.values()),
        "drafts_used": gen.drafts_used,
        "phases": gen.phases,
    }


def speedup_summary(rows: list[dict], plain_rows: list[dict]) -> dict:
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
        "tokens_per_s": round(tps, 2),  # prompt processing included
        "prefill_s": round(sum(r.get("prefill_s", 0.0) for r in rows), 3),
        "decode_ms_per_token": decode_ms_per_token(rows),
        "speedup": round(tps / plain_tps, 3),
        # The worst prompt's own ratio to plain: "never loses" is about this, not the mean.
        "worst_prompt_speedup": worst_prompt(rows, plain_rows),
        "acceptance": round(accepted / proposed, 4) if proposed else None,
        "mean_accepted_length": round(accepted / draft_rounds, 3) if draft_rounds else None,
        "tokens_per_round": round(tokens / rounds, 3) if rounds else None,
        "identical_to_plain": all(r["identical"] for r in rows),
        "tokens": tokens,
        "seconds": round(secs, 3),
        "engine_overhead_share": round(1 - forward / secs, 4) if forward else None,
        "prompts": len(rows),
    }


def decode_ms_per_token(rows: list[dict]) -> float | None:
    """Decoding's time per generated token (the prompt's share taken out): where two configs'
    rates part, this says whether decoding or prompt processing parted them. None for a peer
    that does not time its prompt apart."""
    if not rows or any("prefill_s" not in r for r in rows):
        return None
    decode_s = sum(r["seconds"] - r["prefill_s"] for r in rows)
    return round(decode_s / max(sum(r["tokens"] for r in rows), 1) * 1e3, 3)


def worst_prompt(rows: list[dict], plain_rows: list[dict]) -> float | None:
    plain = {r["id"]: r["tokens"] / max(r["seconds"], 1e-9) for r in plain_rows}
    ratios = [
        r["tokens"] / max(r["seconds"], 1e-9) / plain[r["id"]] for r in rows if r["id"] in plain
    ]
    return round(min(ratios), 3) if ratios else None


def round_profile(rows: list[dict], costs, draft: str | None) -> dict:
    """Milliseconds per round in each phase; predicted vs measured tokens/s for one draft."""
    rounds = sum(r.get("rounds", 0) for r in rows)
    if not rounds:
        return {}
    phases = {p: sum(r["phases"][p] for r in rows) for p in ROUND_PHASES}  # prefill: per round too
    secs = sum(r["seconds"] for r in rows)
    profile: dict = {
        "ms_per_round": {p: round(v / rounds * 1e3, 3) for p, v in phases.items()},
        "other_ms_per_round": round((secs - sum(phases.values())) / rounds * 1e3, 3),
    }
    proposed = sum(r.get("proposed", 0) for r in rows)
    if draft is not None and DraftAsk.parse(draft).named is not None and proposed:
        draft_rounds = max(sum(r.get("draft_rounds", 0) for r in rows), 1)
        alpha = sum(r["accepted"] for r in rows) / proposed
        k_mean = proposed / draft_rounds  # what the draft really proposed per round
        share = draft_rounds / rounds  # rounds that drafted at all (lookups miss)
        k_round = max(round(k_mean), 1)
        tokens = share * expected_tokens(alpha, k_round) + (1 - share)
        seconds = share * costs.round_seconds(draft, k_round) + (1 - share) * costs.verify(1)
        profile["predicted_tokens_per_s"] = round(tokens / seconds, 2)
        profile["measured_tokens_per_s"] = round(
            sum(r["tokens"] for r in rows) / max(secs, 1e-9), 2
        )
    return profile


def run_engine_bench(
    settings: Settings,
    out: str,
    plot: str | None = None,
    per_category: int = 10,
    max_tokens: int | str = 96,
    k_fixed: int = 4,
    categories: list[str] | None = None,
    workload: str = "mtbench",
    peer_server: bool = True,
    only: list[str] | None = None,
    max_file_tokens: int | None = None,
    context_tokens: int | None = None,
) -> dict:
    """`only`: run just these configs (by name; plain decoding always runs, it is the
    baseline). An unknown name is an error that lists the names there are.
    `max_file_tokens`: the edit workloads' longest file (default: what the target's trained
    context leaves beside max_tokens). `context_tokens`: the edit prompts made that long with
    the project's other files before them (edit_workload.with_project_context).
    `max_tokens = "file"` (edit workloads): each answer as long as its file."""
    workloads = ["mtbench", "heldout"] if workload == "both" else [workload]
    if max_tokens == "file" and any(w not in EDIT_WORKLOADS for w in workloads):
        raise ValueError("max_tokens 'file' is for the edit workloads, whose answers are files")
    prompts: dict[str, list[BenchPrompt]] = {}
    edits: dict[str, dict] = {}  # per edit workload: its files, those skipped, the context
    for w in workloads:
        if w not in EDIT_WORKLOADS:
            prompts[w] = load_workload(w, per_category, categories)
            continue
        loaded, skipped = load_edit_workload(w, per_category, categories)
        n_ctx = settings.n_ctx if isinstance(settings.n_ctx, int) else 0
        target = resolve_model_path(settings.target)
        kept, too_long, n_ctx = fit_context(loaded, target, max_tokens, n_ctx, max_file_tokens)
        if context_tokens:
            long = with_project_context(kept, target, context_tokens)
            kept, over, n_ctx = fit_context(long, target, max_tokens, n_ctx)
            if over:  # the trained context cannot hold it: no figure at another length
                raise ValueError(f"--context-tokens {context_tokens}: {over[0]['reason']}")
        # The context holds the longest prompt and its answer (the default 2,048 would not).
        settings = settings.model_copy(update={"n_ctx": n_ctx})
        prompts[w] = list(kept)
        edits[w] = {
            "heldout": EDIT_WORKLOADS[w] == "heldout",
            "context_tokens": context_tokens,
            "files": [{"id": p.id, "kind": p.category, **p.source} for p in kept],
            "skipped": skipped + too_long,
        }
    rt, pool, peer_draft = open_bench_runtime(settings)
    # (name, draft, k, policy): `memspec` is the default policy; `auto` the bare decision rule.
    configs: list[tuple[str, str, int | None, str | None]] = [("none", "none", None, None)]
    for d in pool:
        configs += [(f"{d} k={k_fixed}", d, k_fixed, None), (f"{d} adaptive-k", d, None, None)]
    configs += [("memspec", "auto", None, "memspec"), ("auto", "auto", None, "auto")]
    peer_draft_file = (peer_draft, rt.draft_admin.manifest(peer_draft)) if peer_draft else None
    if only is not None:
        known = [n for n, *_ in configs] + [PEER]
        known += list(peer_configs(draft_file(peer_draft_file)))
        unknown = [n for n in only if n not in known]
        if unknown:
            rt.close()
            raise ValueError(f"unknown bench configs {unknown}; there are: {', '.join(known)}")
        configs = [c for c in configs if c[0] == "none" or c[0] in only]
    peer = PeerPromptLookup(settings, k_fixed) if only is None or PEER in only else None
    servers, skipped = start_peer_servers(settings, peer_server, peer_draft_file, only)
    params = SamplingParams(max_tokens=max_tokens if isinstance(max_tokens, int) else 0)
    results: dict[str, dict[str, list[dict]]] = {w: defaultdict(list) for w in workloads}
    try:
        # Warm up: every config once on a prompt outside the workloads, so draft loads and the
        # first cost corrections are not charged to the first prompt of one config only.
        warm = rt.requests.prompt_tokens(
            messages=[{"role": "user", "content": "Say hello in one line."}]
        )
        for _name, draft, k, policy in configs:
            rt.generate(warm, SamplingParams(max_tokens=16), draft=draft, k=k, policy=policy)
        for w in workloads:
            # A fresh estimator per config and workload: nothing learnt on one workload is
            # carried into the other's figures.
            estimators = {name: rt.new_estimator() for name, *_ in configs}
            for p in tqdm(prompts[w], desc=f"bench engine ({w})", unit="prompt"):
                _run_prompt(rt, p, params, configs, estimators, results[w], peer, servers)
        at_context = {w: ceiling_at_context(rt, results[w]["none"]) for w in edits}
    finally:
        if peer is not None:
            peer.close()
        for server in servers.values():
            server.close()
        rt.close()

    report: dict = {
        "benchmark": "engine",
        "target": settings.target,
        "n_ctx": settings.n_ctx,
        "kv_cache": settings.kv_cache.describe(),
        "n_threads": settings.n_threads,
        "k_max": settings.k_max,
        "max_tokens": max_tokens,
        "k_fixed": k_fixed,
        "per_category": per_category,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "costs_ms": {
            "verify": [round(s * 1e3, 3) for s in rt.costs.verify_s],
            "draft_per_token": {k: round(v * 1e3, 3) for k, v in rt.costs.draft_s.items()},
        },
        "ceiling": decode_ceiling(rt.costs.verify_s),
        "peer_server_skipped": skipped,
        "workloads": {},
    }
    draft_of = {name: d for name, d, *_ in configs}
    for w in workloads:
        cats = sorted({p.category for p in prompts[w]})
        section: dict = {"prompts": len(prompts[w]), "categories": cats, "configs": {}}
        plain = results[w]["none"]
        for name, rows in results[w].items():
            entry: dict = {"overall": speedup_summary(rows, plain), "per_category": {}}
            for c in cats:
                entry["per_category"][c] = speedup_summary(
                    [r for r in rows if r["category"] == c],
                    [r for r in plain if r["category"] == c],
                )
            if name in draft_of:
                entry["round_profile"] = round_profile(rows, rt.costs, draft_of[name])
            entry["runs"] = rows
            section["configs"][name] = entry
        ours = [e for n, e in section["configs"].items() if n in draft_of]
        section["all_identical"] = all(e["overall"]["identical_to_plain"] for e in ours)
        section["lossless"] = section["all_identical"]  # auto's (every config's) = plain's
        section["ceiling_speedup"] = prefill_ceiling(plain, report["ceiling"]["speedup"])
        if w in edits:
            section.update(edits[w])
            c = at_context[w]
            c["with_prefill"] = prefill_ceiling(plain, c["speedup"])
            section["ceiling_at_context"] = c
        report["workloads"][w] = section
    report["all_identical"] = all(s["all_identical"] for s in report["workloads"].values())
    report["lossless"] = report["all_identical"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    for w, section in report["workloads"].items():
        print_speedup_table(w, section)
    if plot:
        _plot(report, plot)
    return report


def decode_ceiling(verify_s: list[float]) -> dict:
    """A free draft that is always right, at its best k on the verify curve (verify_s[b - 1]:
    a batch of b): k and its speedup over plain decoding, decoding alone."""
    if not verify_s:
        return {"k": 0, "speedup": 1.0}
    b = max(range(1, len(verify_s) + 1), key=lambda b: b / verify_s[b - 1])
    return {"k": b - 1, "speedup": round(b * verify_s[0] / verify_s[b - 1], 3)}


def ceiling_at_context(rt: Runtime, plain: list[dict]) -> dict:
    """decode_ceiling on the verify curve measured where these prompts decode: at the median
    context of their plain runs (the prompt and half the answer). The calibrated curve is
    measured at 128 tokens of context; a long one adds attention to every verified row."""
    context = int(statistics.median(r["prompt_tokens"] + r["tokens"] // 2 for r in plain))
    verify_s = measure_verify(rt.target, rt.settings.k_max, context_tokens=context)
    verify_ms = [round(v * 1e3, 3) for v in verify_s]
    return {"context_tokens": context, "verify_ms": verify_ms, **decode_ceiling(verify_s)}


def prefill_ceiling(plain: list[dict], decode_speedup: float) -> float | None:
    """The ceiling with prompt processing counted: plain's prefill as it was, its decoding
    sped up by `decode_speedup`."""
    secs = sum(r["seconds"] for r in plain)
    prefill = sum(r.get("prefill_s", 0.0) for r in plain)
    if secs <= 0:
        return None
    return round(secs / (prefill + (secs - prefill) / decode_speedup), 3)


def draft_file(draft: tuple[str, DraftManifest] | None) -> tuple[str, Path] | None:
    """(id, GGUF) of a model draft, as llama-server's -md takes it."""
    return (draft[0], draft[1].model_path(models_dir())) if draft else None


def start_peer_servers(
    settings: Settings,
    wanted: bool,
    draft: tuple[str, DraftManifest] | None,
    only: list[str] | None = None,
) -> tuple[dict[str, PeerServer], str]:
    if not wanted:
        return {}, "not asked for (--no-peer-server)"
    configs = peer_configs(draft_file(draft))
    if only is not None:
        configs = {n: f for n, f in configs.items() if n in only}
        if not configs:
            return {}, "no llama-server config asked for (--configs)"
    binary = PeerServer.find()
    if binary is None:
        return {}, "llama-server not built: run scripts/setup.sh --peer"
    servers: dict[str, PeerServer] = {}
    try:
        for name, flags in configs.items():
            servers[name] = PeerServer(binary, settings, flags)
    except Exception as e:  # a peer that will not start is reported, not fatal
        for server in servers.values():
            server.close()
        return {}, f"llama-server did not start: {e}"
    return servers, ""


def _run_prompt(
    rt: Runtime,
    p: BenchPrompt,
    params: SamplingParams,
    configs: list[tuple[str, str, int | None, str | None]],
    estimators: dict,
    results: dict[str, list[dict]],
    peer: PeerPromptLookup | None,
    servers: dict[str, PeerServer],
) -> None:
    if p.chat:
        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": p.text}])
    else:
        prompt = rt.requests.prompt_tokens(prompt=p.text)
    base: dict = {"id": p.id, "category": p.category, "prompt_tokens": len(prompt)}
    if isinstance(p, EditPrompt):
        base["heldout"] = p.heldout
        if p.answer_tokens is not None:  # a whole file's answer
            params = replace(params, max_tokens=p.answer_tokens)
            base["max_tokens"] = p.answer_tokens
    plain_ids: list[int] = []
    for name, draft, k, policy in configs:
        fwd0 = _forward_s(rt)
        rt.target.reset()  # no KV reuse across configs: each pays its prefill
        # A named policy keeps its own statistics across prompts; the rule gets the config's.
        est = None if policy == "memspec" else estimators[name]
        gen = rt.generate(prompt, params, draft=draft, k=k, estimator=est, policy=policy)
        if name == "none":
            plain_ids = gen.token_ids
        results[name].append(
            {
                **base,
                **generation_row(gen),
                "tokens_per_s": round(gen.tokens_per_s, 2),
                "prefill_s": round(gen.phases["prefill"], 4),
                "forward_s": _forward_s(rt) - fwd0,
                "identical": gen.token_ids == plain_ids,
            }
        )
    if peer is not None:
        ids, secs = peer.generate(prompt, params.max_tokens)
        results[PEER].append(
            {
                **base,
                "tokens": len(ids),
                "seconds": secs,
                "tokens_per_s": round(len(ids) / max(secs, 1e-9), 2),
                "identical": ids == plain_ids,
            }
        )
    for name, server in servers.items():
        done = server.complete(prompt, params.max_tokens, rt.target.eos_token_ids)
        results[name].append(
            {
                **base,
                "tokens": len(done.tokens),
                "seconds": done.seconds,
                "tokens_per_s": round(len(done.tokens) / max(done.seconds, 1e-9), 2),
                "prefill_s": round(done.prefill_s, 4),
                "proposed": done.drafted,
                "accepted": done.accepted,
                "identical": done.tokens == plain_ids,
            }
        )


def _forward_s(rt: Runtime) -> float:
    drafts = [d.backend for d in rt.drafts.values() if hasattr(d, "backend")]
    return rt.target.forward_s + sum(b.forward_s for b in drafts)


def print_speedup_table(workload: str, section: dict) -> None:
    cats = section["categories"]
    print(f"\n{workload}: {section['prompts']} prompts; speedup over plain (worst prompt)")
    if section.get("ceiling_speedup"):
        print(f"ceiling (a free draft always right, prompt processing included): "
              f"{section['ceiling_speedup']:.2f}")  # fmt: skip
    if c := section.get("ceiling_at_context"):
        print(f"  on the verify curve at {c['context_tokens']} tokens of context: "
              f"{c['with_prefill']:.2f} ({c['speedup']:.2f} decoding, k={c['k']})")  # fmt: skip
    width = max([34, *(len(name) for name in section["configs"])])  # peer names run long
    # ms/tok: decoding's time per token, the prompt's share taken out (decode_ms_per_token).
    print(
        f"{'config':{width}s} {'overall':>13s} {'ms/tok':>7s} "
        + " ".join(f"{c[:8]:>8s}" for c in cats)
    )
    for name, e in section["configs"].items():
        o = e["overall"]
        ms = o.get("decode_ms_per_token")
        cells = " ".join(f"{e['per_category'][c]['speedup']:8.2f}" for c in cats)
        same = "" if o["identical_to_plain"] else "  (outputs differ!)"
        print(
            f"{name:{width}s} {o['speedup']:6.2f} ({o['worst_prompt_speedup'] or 0:4.2f}) "
            f"{'-' if ms is None else f'{ms:.1f}':>7s} {cells}{same}"
        )


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sections = report["workloads"]
    fig, axes = plt.subplots(len(sections), 1, figsize=(14, 5 * len(sections)), squeeze=False)
    for ax, (w, section) in zip(axes[:, 0], sections.items(), strict=True):
        cats = section["categories"]
        names = list(section["configs"])
        x = np.arange(len(cats) + 1)
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            e = section["configs"][n]
            vals = [e["per_category"][c]["speedup"] for c in cats] + [e["overall"]["speedup"]]
            ax.bar(x + i * width, vals, width, label=n)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x + 0.4 - width / 2, cats + ["overall"], rotation=20)
        ax.set_ylabel("speedup over plain decoding (same run)")
        ax.set_title(
            f"memspec bench engine — {w}: {section['prompts']} prompts, "
            f"greedy, {report['max_tokens']} tokens"
        )
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
