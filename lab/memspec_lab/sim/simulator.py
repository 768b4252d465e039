"""Trace-driven simulator: replay requests under a device profile, a byte budget and a policy.

Each round is chosen by the daemon's own Scheduler (memspec.scheduler.rounds), over a
SimWorkingSet in virtual time and trace-backed drafts (TraceDraft): the same code picks
(draft, k) as live, memspec's rounds the decision rule over the resident drafts with its
primed estimates, lookup shadows and catch-up charges. The trace says how many of the
proposed tokens the target accepts at this output position (exact for greedy decoding,
whatever sequence of drafts and k the policy picks); the profile says what the round costs:
draft steps (plus a batched catch-up when the draft has not seen the latest context), the
target's verification of k + 1 tokens, the engine's per-round overhead, and any wait on a
reactive load. Background loads run on one loader in virtual time and may slow decoding by
the profile's contention factor.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memspec.drafts.model import DONOR_MIN_TOKENS
from memspec.drafts.prompt_lookup import key_match
from memspec.engine.costs import AcceptanceEstimator
from memspec.engine.types import Draft, Proposal, SamplingParams
from memspec.paths import DEFAULT_PREDICTOR
from memspec.predictor.model import AcceptancePredictor, load_or_fallback
from memspec.scheduler.policies import (
    DraftInfo,
    Env,
    OracleEntry,
    OraclePolicy,
    Policy,
    Request,
    make_policy,
    prompt_key,
)
from memspec.scheduler.rounds import Scheduler
from memspec.units import parse_size
from memspec_lab.sim.profile import DraftCost, Profile
from memspec_lab.sim.traces import DraftPositions, Trace, TraceRequest
from memspec_lab.sim.train_predictor import cells_of
from memspec_lab.sim.working_set import SimWorkingSet


@dataclass
class Setup:
    """A trace's drafts costed by a profile."""

    profile: Profile
    env: Env
    dcost: dict[str, DraftCost]
    max_tokens: int

    @property
    def all_drafts_bytes(self) -> int:
        return sum(c.bytes for c in self.dcost.values())


def build_setup(trace: Trace, profile: Profile) -> Setup:
    dcost, infos = {}, {}
    for d, h in trace.header["drafts"].items():
        c = profile.draft(d, int(h["bytes"]), h["kind"])
        dcost[d] = c
        shares_kv = bool(h.get("shares_target_kv")) and c.kv_copy_s is not None
        infos[d] = DraftInfo(d, h["kind"], c.bytes, profile.load_s(c), shares_kv)
    env = Env(infos, profile.cost_model(dcost), int(trace.header["settings"]["k_max"]))
    env.costs.prefill_s = {
        d: c.prefill_s_per_token for d, c in dcost.items() if c.prefill_s_per_token
    }
    return Setup(profile, env, dcost, int(trace.header["settings"]["max_tokens"]))


def resolve_budget(budget: str | int, setup: Setup) -> int:
    """Bytes for target + drafts. 'auto': the target plus the largest single draft."""
    if budget == "auto":
        return setup.profile.target_bytes + max((c.bytes for c in setup.dcost.values()), default=0)
    return parse_size(budget)


def request_of(r: TraceRequest, max_tokens: int) -> Request:
    return Request(r.id, r.prompt, r.text, r.turn, max_tokens)


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    requests: int = 0
    policy_s: float = 0.0  # host time inside the policy (this machine's Python, not the device)


class TraceDraft(Draft):
    """A draft of the trace, replayed: at output position i it proposes what the trace says it
    did from prompt + output[:i] (length[i] tokens, the first run[i] of them the target's own,
    then tokens the target would not produce), so the decision rule and its lookup shadows see
    what they would live. `seen`: the context each model draft's KV cache holds (the
    simulator's, per request); `peeked`: every id asked to propose this round."""

    def __init__(
        self,
        info: DraftInfo,
        positions: DraftPositions,
        prompt_len: int,
        output: list[int],
        seen: dict[str, int],
        peeked: list[str],
    ):
        self.id, self.kind, self.free = info.id, info.kind, info.free
        self.catches_up = info.catches_up
        self.positions, self.prompt_len, self.output = positions, prompt_len, output
        self.seen, self.peeked = seen, peeked

    def key_at(self, pos: int) -> str:
        """The statistic key of the proposal at output position `pos`."""
        keys = self.positions.keys
        return f"{self.id}/{keys[pos]}" if keys is not None and keys[pos] else self.id

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        self.peeked.append(self.id)
        pos = len(context) - self.prompt_len
        n = min(k, self.positions.length[pos])
        right = self.output[pos : pos + min(self.positions.run[pos], n)]
        key = self.key_at(pos)  # a lookup's key says its match length, as it did live
        return Proposal(right + [-1] * (n - len(right)), key=key, match=key_match(key))

    def catchup_tokens(self, context: list[int]) -> int:
        return len(context) - self.seen.get(self.id, 0) if self.catches_up else 0


def scheduler_for(setup: Setup, ws: SimWorkingSet) -> Scheduler:
    """The daemon's Scheduler over the simulated working set, timed by its virtual clock."""
    env = setup.env
    return Scheduler(ws, env.costs, AcceptanceEstimator(), env.k_max, clock=lambda: ws.now)


def run_request(
    r: TraceRequest,
    rounds: Scheduler,
    policy: Policy,
    ws: SimWorkingSet,
    setup: Setup,
    tot: Totals,
) -> None:
    prof, env, costs = setup.profile, setup.env, setup.dcost
    verify = prof.verify_s
    n = len(r.output)
    seen: dict[str, int] = {}  # context tokens each draft's KV cache covers
    peeked: list[str] = []
    ws.drafts = {
        d: TraceDraft(info, r.drafts[d], len(r.prompt), r.output, seen, peeked)
        for d, info in env.drafts.items()
        if d in r.drafts
    }
    t = ws.now
    c0 = time.perf_counter()
    rounds.begin_policy(policy, request_of(r, setup.max_tokens))
    tot.policy_s += time.perf_counter() - c0
    prefill = prof.target_prefill_s_per_token * (len(r.prompt) - 1)
    if ws.loading():
        prefill *= 1 + prof.load_contention
    t += prefill
    params = SamplingParams(max_tokens=setup.max_tokens)
    rng = np.random.default_rng(0)  # trace drafts draw nothing
    context = list(r.prompt)
    pos = 0
    while pos < n:
        ws.advance(t)
        peeked.clear()
        k_room = setup.max_tokens - pos - 1
        before = set(ws.resident) if policy.reactive else None
        c0 = time.perf_counter()
        choice = rounds.choose(context, k_room, params, rng)
        tot.policy_s += time.perf_counter() - c0
        stall = ws.now - t  # a reactive load waited for
        draft, k = choice.draft, choice.k
        key = ""
        proposed = accepted = 0
        dt = 0.0
        if isinstance(draft, TraceDraft) and k > 0:
            d = draft.id
            if before is not None and d not in before:
                seen.pop(d, None)  # loaded just now: its KV holds nothing
            ws.touch(d)
            pd = r.drafts[d]
            proposed = min(k, pd.length[pos], max(k_room, 0))
            accepted = min(proposed, pd.run[pos])
            key = draft.key_at(pos)
            c = costs[d]
            if c.s_per_token:
                gap = len(r.prompt) + pos - seen.get(d, 0)
                dt += c.s_per_token * proposed + catchup_s(c, gap, env.drafts[d].shares_target_kv)
                seen[d] = len(r.prompt) + pos + min(accepted, max(proposed - 1, 0))
        for p in peeked:
            dt += costs[p].overhead_s
        b = proposed + 1
        dt += (verify[b - 1] if b <= len(verify) else verify[-1]) + prof.round_overhead_s
        if ws.loading():
            dt *= 1 + prof.load_contention
        t += stall + dt
        tokens = min(accepted + 1, n - pos)
        if proposed:
            c0 = time.perf_counter()
            rounds.observe(key, proposed, accepted, stall + dt)
            tot.policy_s += time.perf_counter() - c0
        tot.proposed += proposed
        tot.accepted += accepted
        tot.rounds += 1
        context += r.output[pos : pos + tokens]
        pos += tokens
    ws.advance(t)
    ws.now = t
    c0 = time.perf_counter()
    rounds.finish()
    tot.policy_s += time.perf_counter() - c0
    tot.tokens += n
    tot.requests += 1


def catchup_s(c: DraftCost, gap: int, shares_target_kv: bool) -> float:
    """A model draft's catch-up on `gap` context tokens it has not seen: a copy of the target's
    cache when it shares it (ModelDraft's rule: the target holds all but the newest token),
    else a batched prefill; a gap of one or two rides on the first draft step."""
    if shares_target_kv and gap - 1 >= DONOR_MIN_TOKENS:
        return c.kv_copy_s or 0.0
    return c.prefill_s_per_token * gap if gap > 2 else 0.0


def request_alphas(r: TraceRequest) -> dict[str, float]:
    """The request's actual acceptance per statistic key (what an oracle knows in advance)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for c in cells_of(r):
        acc[c.key][0] += c.accepted
        acc[c.key][1] += c.compared
    return {k: a / n for k, (a, n) in acc.items() if n}


def oracle_table(trace: Trace, setup: Setup) -> dict[str, OracleEntry]:
    """Per prompt, the single draft (or none) with the most tokens/s, all drafts resident."""
    table: dict[str, OracleEntry] = {}
    unlimited = 1 << 62
    sizes = {d: c.bytes for d, c in setup.dcost.items()}
    for r in trace.requests:
        alphas = request_alphas(r)
        best, best_s = None, float("inf")
        for cand in [None, *setup.env.drafts]:
            entry = OracleEntry(cand, alphas)
            ws = SimWorkingSet(unlimited, sizes, {d: 0.0 for d in sizes})
            ws.resident = {d: 0.0 for d in sizes}
            oracle = OraclePolicy(setup.env, {prompt_key(r.prompt): entry})
            run_request(r, scheduler_for(setup, ws), oracle, ws, setup, Totals())
            if ws.now < best_s - 1e-12:
                best, best_s = cand, ws.now
        table[prompt_key(r.prompt)] = OracleEntry(best, alphas)
    return table


def sim_workload(trace: Trace, n: int | None, seed: int = 0, run_questions: int = 2):
    """Trace requests in category runs (both turns of a question together); when more requests
    are asked for than the trace holds, further passes shuffle the order of the runs."""
    by_cat: dict[str, list[list[TraceRequest]]] = defaultdict(list)
    for r in trace.requests:
        convs = by_cat[r.category]
        if not convs or convs[-1][0].question_id != r.question_id:
            convs.append([])
        convs[-1].append(r)
    runs: list[list[TraceRequest]] = []
    cats = list(by_cat)
    width = max(len(v) for v in by_cat.values())
    for i in range(0, width, run_questions):
        for c in cats:
            chunk = [r for conv in by_cat[c][i : i + run_questions] for r in conv]
            if chunk:
                runs.append(chunk)
    total = n if n is not None else len(trace.requests)
    rng = random.Random(seed)
    order = list(runs)
    out: list[TraceRequest] = []
    while len(out) < total:
        for run in order:
            out.extend(run)
        rng.shuffle(order)
    return out[:total]


def simulate(
    trace: Trace,
    setup: Setup,
    policy: Policy,
    budget_bytes: int,
    workload: list[TraceRequest],
) -> dict:
    """Replay `workload` with one policy; the same summary the live bench reports."""
    drafts_budget = budget_bytes - setup.profile.target_bytes
    if drafts_budget < 0:
        raise ValueError(
            f"budget {budget_bytes} B is below the target's {setup.profile.target_bytes} B"
        )
    sizes = {d: c.bytes for d, c in setup.dcost.items()}
    loads = {d: i.load_s for d, i in setup.env.drafts.items()}
    ws = SimWorkingSet(drafts_budget, sizes, loads)
    tot = Totals()
    rounds = scheduler_for(setup, ws)
    wall = time.perf_counter()
    for r in workload:
        run_request(r, rounds, policy, ws, setup, tot)
    return {
        "tokens_per_s": round(tot.tokens / ws.now, 3) if ws.now else 0.0,
        "stall_s": round(ws.stall_s, 4),
        "loads": ws.loads,
        "evictions": ws.evictions,
        "acceptance": round(tot.accepted / tot.proposed, 4) if tot.proposed else None,
        "peak_bytes": setup.profile.target_bytes + ws.peak_bytes,
        "tokens": tot.tokens,
        "seconds": round(ws.now, 3),
        "requests": tot.requests,
        "rounds": tot.rounds,
        "policy_host_us_per_round": round(tot.policy_s / max(tot.rounds, 1) * 1e6, 2),
        "sim_wall_s": round(time.perf_counter() - wall, 3),
    }


def policy_for(
    spec: str,
    setup: Setup,
    trace: Trace,
    predictor: AcceptancePredictor | str | Path | None = None,
    oracle: dict[str, OracleEntry] | None = None,
    seed: int = 0,
) -> Policy:
    if spec == "memspec":
        if not isinstance(predictor, AcceptancePredictor):
            predictor = load_or_fallback(Path(predictor) if predictor else DEFAULT_PREDICTOR)
    if spec == "oracle" and oracle is None:
        oracle = oracle_table(trace, setup)
    return make_policy(spec, setup.env, predictor, oracle, seed)


def simulate_policy(
    trace: Trace,
    profile: Profile,
    spec: str,
    budget: str | int,
    requests: int | None = None,
    predictor: str | Path | None = None,
    seed: int = 0,
) -> dict:
    """`memspec simulate`: one policy on a trace under a profile and budget."""
    setup = build_setup(trace, profile)
    budget_bytes = resolve_budget(budget, setup)
    policy = policy_for(spec, setup, trace, predictor, seed=seed)
    result = simulate(trace, setup, policy, budget_bytes, sim_workload(trace, requests, seed))
    return {
        "policy": spec,
        "profile": profile.name,
        "budget_bytes": budget_bytes,
        **result,
        "status": policy.status(),
    }
