"""The live half of `memspec bench policies`: every policy on the real engine, same requests.

Requests come from a trace (collected first if needed): it fixes the prompts (turn 2 follows
the target's own turn-1 answer), the reference outputs every policy must reproduce, and what
the oracle knows. Policies take turns request by request, in a rotating order, each with its
own working set under the same budget; a load a policy's prefetch leaves running after its
request is waited for and charged to that policy, so no load runs in anyone else's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from memspec.drafts.model import ModelDraft
from memspec.engine.costs import AcceptanceEstimator
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import Sequence, decode_round
from memspec.paths import DEFAULT_PREDICTOR
from memspec.predictor.model import load_or_fallback
from memspec.scheduler.policies import DraftInfo, Env, Policy, Request, make_policy
from memspec.scheduler.rounds import Scheduler
from memspec.units import parse_size
from memspec_lab.sim.simulator import oracle_table, sim_workload
from memspec_lab.sim.traces import Trace, TraceRequest, collect, load_trace
from memspec_lab.sim.workload import requests_for
from memspec_lab.testbed import select_questions


@dataclass
class LiveTotals:
    tokens: int = 0
    seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    policy_s: float = 0.0
    idle_wait_s: float = 0.0
    stall_s: float = 0.0
    identical: bool = True
    mismatches: list[str] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # the differing ones


def bench_trace(rt, cfg, out: Path) -> Trace:
    """The trace the live run replays: the workload's requests from --trace if it has them
    all, else a trace collected now (written beside the report)."""
    questions = select_questions(cfg.per_category, cfg.offset, cfg.categories)
    specs = requests_for(questions, cfg.turns)
    if cfg.trace and Path(cfg.trace).is_file():
        trace = load_trace(cfg.trace)
        have = trace.by_id()
        missing = [s.id for s in specs if s.id not in have]
        if missing:
            raise ValueError(f"{cfg.trace} lacks {len(missing)} workload requests: {missing[:4]}")
        trace.requests = [have[s.id] for s in specs]
        return trace
    path = out.with_suffix(".trace.jsonl")
    return collect(rt, specs, path, max_tokens=cfg.max_tokens, load_reps=1, with_runs=False)


def draft_env(rt, trace: Trace) -> Env:
    """Drafts as the trace measured them (sizes, real load times, catch-up rates)."""
    import statistics

    infos = {}
    for d, h in trace.header["drafts"].items():
        infos[d] = DraftInfo(d, h["kind"], int(h["bytes"]), float(h.get("load_s_median", 0.0)))
    env = Env(infos, rt.costs, rt.settings.k_max)
    for d in infos:
        xs = [
            r.timing[f"prefill_s_per_token/{d}"]
            for r in trace.requests
            if f"prefill_s_per_token/{d}" in r.timing
        ]
        if xs:
            env.costs.prefill_s[d] = statistics.median(xs)
    return env


def pool_source(rt, sizes: dict[str, int]):
    """Real loads of the pool's drafts (mmap off), sized like the trace says."""
    from memspec.drafts.registry import instantiate
    from memspec.scheduler.working_set import FactorySource

    kinds = {d: rt.draft_admin.manifest(d).kind for d in sizes}
    # Private copies: a policy's loads must read the file, not join the runtime's resident
    # drafts' weights (backends.shared_weights).
    options = replace(rt.options, share_weights=False)
    return FactorySource(
        lambda d: instantiate(
            rt.draft_admin.manifest(d), options, rt.settings.backend, target_backend=rt.target
        ),
        sizes,
        kinds,
    )


def new_working_set(rt, trace: Trace, budget: int):
    """A policy's own working set: same budget, the target's bytes reserved, no drafts yet
    but the weightless ones (always resident)."""
    from memspec.scheduler.working_set import WorkingSet

    sizes = {d: int(h["bytes"]) for d, h in trace.header["drafts"].items()}
    ws = WorkingSet(pool_source(rt, sizes), budget, int(trace.header["target"]["bytes"]))
    for d, b in sizes.items():
        if b == 0:
            ws.load(d)
    return ws


def preload(ws, draft_ids: list[str]) -> None:
    """The configured drafts, in order, as far as the budget allows (never evicting)."""
    from memspec.errors import BudgetExceeded

    for d in draft_ids:
        try:
            ws.load(d, evict=False)
        except BudgetExceeded:
            continue
    ws.wait_idle(timeout=120.0)


def wait_idle(ws, timeout: float = 120.0) -> float:
    """Block until the working set's loader is idle; return the seconds waited."""
    t = time.perf_counter()
    ws.wait_idle(timeout)
    return time.perf_counter() - t


def run_one(
    rt,
    ws,
    policy: Policy | None,
    est: AcceptanceEstimator,
    req: TraceRequest,
    max_tokens: int,
    tot: LiveTotals,
) -> None:
    """One request under `policy` (None: auto, the bare decision rule), as the daemon runs it;
    `est` is the policy's own acceptance learnt across its requests."""
    with ws.leased():
        for draft in ws.lease_resident():  # every request starts with cold draft KV (as traced)
            if isinstance(draft, ModelDraft):
                draft.backend.reset()
    rt.target.reset()
    params = SamplingParams(max_tokens=max_tokens)
    t = time.perf_counter()
    rounds = Scheduler(ws, rt.costs, est, rt.settings.k_max)
    if policy is None:
        rounds.begin(req.prompt, params, policy="auto", estimator=est)
    else:
        request = Request(req.id, req.prompt, req.text, req.turn, max_tokens)
        rounds.begin_policy(policy, request, est)
    with rt.lock:  # each round's drafts leased until it ends, as the daemon's rounds are
        seq = Sequence(rt.target, req.prompt, params, rounds)
        while not seq.done:
            with ws.leased():
                decode_round(rt.target.kv_owner, [seq])
        if seq.error is not None:
            raise seq.error
        gen = seq.result()
    stats = rounds.finish()
    idle = wait_idle(ws)
    tot.seconds += time.perf_counter() - t
    tot.idle_wait_s += idle
    tot.tokens += gen.completion_tokens
    tot.proposed += gen.proposed
    tot.accepted += gen.accepted
    tot.rounds += gen.rounds
    tot.policy_s += stats.policy_s
    tot.stall_s += stats.stall_s
    if gen.token_ids != req.output:
        tot.identical = False
        tot.mismatches.append(req.id)
        tot.outputs[req.id] = gen.token_ids


def run_live(settings, cfg, out: Path) -> dict:
    from memspec.drafts.family import settings_pool_dir
    from memspec.drafts.manifest import load_manifests
    from memspec.runtime import Runtime
    from memspec_lab.bench.policies import policy_names, summarise

    # The runtime loads the whole pool once: calibration (cached) and the trace need it.
    configured = settings.drafts  # what auto's working set preloads, as the daemon's
    settings = settings.model_copy(
        update={"drafts": list(load_manifests(settings_pool_dir(settings)))}
    )
    rt = Runtime(settings)
    if configured is None:  # the whole family, as the daemon's default
        configured = [d for d in rt.preload_ids if d not in rt.draft_admin.incompatible]
    sets: dict = {}
    try:
        trace = bench_trace(rt, cfg, out)
        for d in list(rt.drafts):  # from here on drafts live in the policies' working sets
            rt.draft_admin.unload_draft(d)
        env = draft_env(rt, trace)
        budget = resolve_live_budget(cfg.budget, trace, env)
        workload = sim_workload(trace, None, cfg.seed)
        oracle = oracle_table(trace, _this_machine_setup(trace, rt))
        names = policy_names(trace, cfg.policies, live=True)
        predictor_path = Path(cfg.predictor) if cfg.predictor else DEFAULT_PREDICTOR
        policies: dict[str, Policy | None] = {}
        estimators: dict[str, AcceptanceEstimator] = {}
        for n in names:
            sets[n] = new_working_set(rt, trace, budget)
            if n in ("auto", "memspec"):  # the daemon's working set starts with these
                preload(sets[n], [d for d in configured if d in trace.draft_ids])
            if n == "auto":
                policies[n], estimators[n] = None, rt.new_estimator()
                continue
            pred = load_or_fallback(predictor_path) if n == "memspec" else None
            policies[n] = make_policy(n, env, pred, oracle, cfg.seed)
            estimators[n] = AcceptanceEstimator()
        totals = {n: LiveTotals() for n in names}
        # Counters from here on: the weightless drafts' set-up loads are not the policy's.
        base = {n: (ws.loads, ws.evictions) for n, ws in sets.items()}
        from tqdm import tqdm

        for i, req in enumerate(tqdm(workload, desc="bench policies (live)", unit="req")):
            order = names[i % len(names) :] + names[: i % len(names)]
            for n in order:
                max_tokens = trace.header["settings"]["max_tokens"]
                run_one(rt, sets[n], policies[n], estimators[n], req, max_tokens, totals[n])
        report = {
            "mode": "live",
            "budget_bytes": budget,
            "trace": trace.header.get("path", str(cfg.trace or "")),
            "requests": len(workload),
            "max_tokens": trace.header["settings"]["max_tokens"],
            "policies": {},
        }
        for n in names:
            ws, t = sets[n], totals[n]
            report["policies"][n] = {
                "tokens_per_s": round(t.tokens / t.seconds, 3) if t.seconds else 0.0,
                "stall_s": round(ws.stall_s, 4),
                "reactive_stall_s": round(t.stall_s, 4),
                "loads": ws.loads - base[n][0],
                "evictions": ws.evictions - base[n][1],
                "acceptance": round(t.accepted / t.proposed, 4) if t.proposed else None,
                "peak_bytes": ws.peak_bytes,
                "tokens": t.tokens,
                "seconds": round(t.seconds, 3),
                "rounds": t.rounds,
                "identical_to_plain": t.identical,
                "mismatches": t.mismatches,
                "idle_wait_s": round(t.idle_wait_s, 4),
                "policy_overhead_us_per_round": round(t.policy_s / max(t.rounds, 1) * 1e6, 2),
                "policy_overhead_share": round(t.policy_s / t.seconds, 5) if t.seconds else None,
                "status": (
                    p.status() if (p := policies[n]) else {"policy": n, "drafts": configured}
                ),
            }
        report["all_identical"] = all(t.identical for t in totals.values())
        report["divergences"] = explain_divergences(rt, trace, totals)
        return summarise(report)
    finally:
        for ws in sets.values():
            ws.close()
        rt.close()


def explain_divergences(rt, trace: Trace, totals: dict[str, LiveTotals]) -> list[dict]:
    """For each output that differs from plain decoding: where, and the target's top-2 logit
    margin there (a margin near 0 is a floating-point near-tie between the batched
    verification and the single-token reference, not a wrong acceptance)."""
    import numpy as np

    out = []
    by_id = trace.by_id()
    for name, t in totals.items():
        for rid in t.mismatches:
            req = by_id[rid]
            rows = t.outputs.get(rid, [])
            pairs = enumerate(zip(rows, req.output, strict=False))
            i = next((j for j, (a, b) in pairs if a != b), None)
            if i is None:
                i = min(len(rows), len(req.output))
            rt.target.reset()
            logits = rt.target.eval(req.prompt + req.output[:i], all_logits=False)[-1]
            top = np.argsort(-logits)[:2]
            out.append(
                {
                    "policy": name,
                    "request": rid,
                    "position": i,
                    "reference": req.output[i] if i < len(req.output) else None,
                    "got": rows[i] if i < len(rows) else None,
                    "top2_margin": round(float(logits[top[0]] - logits[top[1]]), 6),
                }
            )
    rt.target.reset()
    return out


def resolve_live_budget(budget: str, trace: Trace, env: Env) -> int:
    """Bytes for target + drafts; 'auto': the target plus the largest single draft."""
    if budget != "auto":
        return parse_size(budget)
    target = int(trace.header["target"]["bytes"])
    return target + max((d.bytes for d in env.drafts.values()), default=0)


def _this_machine_setup(trace: Trace, rt):
    """Cost the trace with this run's own calibration, for the oracle's choice per prompt."""
    from memspec_lab.sim.profile import Profile
    from memspec_lab.sim.simulator import build_setup

    c = rt.costs
    profile = Profile(
        name="live",
        memory_bytes=0,
        usable_bytes=0,
        load_bandwidth=1e9,
        load_overhead_s=0.0,
        load_contention=0.0,
        target_bytes=int(trace.header["target"]["bytes"]),
        target_prefill_s_per_token=0.0,
        verify_s=list(c.verify_s),
        round_overhead_s=0.0,
    )
    from memspec_lab.sim.profile import DraftCost

    for d, h in trace.header["drafts"].items():
        profile.drafts[d] = DraftCost(
            bytes=int(h["bytes"]),
            s_per_token=c.draft_s.get(d, 0.0),
            overhead_s=c.draft_overhead_s.get(d, 0.0),
        )
    return build_setup(trace, profile)
