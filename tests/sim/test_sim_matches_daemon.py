"""The simulator chooses each round as the daemon does: on a round recorded from the real
runtime (its drafts asked at every position, as `memspec traces collect` records them), the
daemon's Scheduler over its WorkingSet and the simulator's over a SimWorkingSet with the
trace-backed drafts pick the same (draft, k), round after round, under memspec and auto."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from memspec.config import Settings
from memspec.engine.costs import CostModel
from memspec.engine.types import Choice, SamplingParams
from memspec.paths import models_dir
from memspec.scheduler.policies import DraftInfo, Env, Request, make_policy
from memspec.scheduler.rounds import Scheduler, chat_text
from memspec_lab.sim.simulator import TraceDraft
from memspec_lab.sim.traces import TraceRequest, chat_messages, collect_one
from memspec_lab.sim.working_set import SimWorkingSet
from memspec_lab.sim.workload import RequestSpec

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

QUESTION = "Write the numbers from one to twenty in words, separated by commas."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A Runtime (prompt lookup, a model draft) and one request it recorded."""
    from memspec.drafts.model import ModelDraft
    from memspec.runtime import Runtime

    if not (models_dir() / "smollm2-135m-f32.gguf").is_file():
        pytest.fail("testbed missing: run scripts/setup.sh", pytrace=False)
    settings = Settings.load(
        drafts=["prompt-lookup", "q4_0"],
        n_ctx=512,
        n_threads=1,
        budget="950MB",
        state_dir=tmp_path_factory.mktemp("state"),
    )
    rt = Runtime(settings)
    spec = RequestSpec(1, "extraction", 1, (QUESTION,))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    rec = collect_one(rt, spec, params, {}, settings.k_max, 2, with_runs=False)
    for draft in rt.drafts.values():  # the trace's drafts start cold: so does the daemon's
        if isinstance(draft, ModelDraft):
            draft.backend.reset()
    pin_costs(rt.costs)
    yield rt, spec, rec
    rt.close()


def pin_costs(costs: CostModel) -> None:
    """Both schedulers read the same costs; they are pinned (in place: the runtime's scheduler
    holds them) to a GPU-like profile where drafting pays. The calibrated ones are this CPU's:
    on a box whose verify curve is near-linear the rule rightly never drafts, and a replay with
    no drafting round compares nothing."""
    step = costs.verify_s[0]
    pinned = CostModel(
        [step * (1 + 0.05 * b) for b in range(len(costs.verify_s))],
        draft_s=dict.fromkeys(costs.draft_s, 0.2 * step),
        draft_overhead_s=dict(costs.draft_overhead_s),
        prefill_s=dict(costs.prefill_s),
    )
    costs.__dict__.update(pinned.__dict__)


def picked(c: Choice) -> tuple[str | None, int]:
    return (c.draft.id, c.k) if c.draft is not None and c.k > 0 else (None, 0)


def replay_both(rt, spec: RequestSpec, rec: TraceRequest, policy: str) -> list:
    """Each round of `rec`, chosen by the daemon's scheduler and by the simulator's with the
    same state (costs, drafts, residency, predictor, what earlier rounds observed)."""
    live, ws, k_max = rt.scheduler, rt.working_set, rt.settings.k_max
    params = SamplingParams(max_tokens=MAX_TOKENS)
    messages = chat_messages(spec, None)
    ws.wait_idle(60)
    for d in set(ws.resident_ids()) - set(rec.drafts):  # loaded since (memspec's plan)
        ws.evict(d)
    ws.wait_idle(60)
    live.begin(rec.prompt, params, policy=policy, messages=messages)
    ws.wait_idle(60)  # whatever memspec's plan loads is resident before the first round
    env = Env(dict(live.env.drafts), copy.deepcopy(rt.costs), k_max)
    for d, row in ((r["id"], r) for r in ws.status()):
        env.drafts.setdefault(d, make_info(row))
    infos = env.drafts.values()
    sim_ws = SimWorkingSet(1 << 40, {i.id: i.bytes for i in infos}, {i.id: i.load_s for i in infos})
    sim_ws.drafts = {
        d: TraceDraft(env.drafts[d], rec.drafts[d], len(rec.prompt), rec.output, {}, [])
        for d in rec.drafts
    }
    sim_ws.resident = dict.fromkeys(ws.resident_ids(), 0.0)
    sim = Scheduler(sim_ws, env.costs, copy.deepcopy(rt.estimator), k_max, clock=lambda: 0.0)
    if policy == "auto":
        sim.begin(rec.prompt, params, policy="auto")
    else:
        predictor = copy.deepcopy(live.predictor)
        text, turns = chat_text(messages)
        request = Request("", rec.prompt, text, turns, MAX_TOKENS)
        sim.begin_policy(make_policy(policy, env, predictor), request)
        sim_ws.resident = dict.fromkeys(ws.resident_ids(), 0.0)
    rng = np.random.default_rng(0)
    rounds, pos = [], 0
    while pos < len(rec.output):
        context = rec.prompt + rec.output[:pos]
        k_room = MAX_TOKENS - pos - 1
        ours = live.choose(context, k_room, params, rng)
        theirs = sim.choose(context, k_room, params, rng)
        rounds.append((pos, picked(ours), picked(theirs)))
        draft, k = picked(ours)
        accepted = 0
        if draft is not None:
            positions = rec.drafts[draft]
            proposed = min(k, positions.length[pos])
            accepted = min(proposed, positions.run[pos])
            key = ours.proposal.key if ours.proposal is not None else draft
            for s in (live, sim):
                s.observe(key, proposed, accepted, 0.01)
        pos += accepted + 1
    live.finish()
    sim.finish()
    return rounds


def make_info(row: dict) -> DraftInfo:
    return DraftInfo(row["id"], row["kind"], int(row["bytes"] or 0), float(row["load_s"] or 0))


@pytest.mark.parametrize("policy", ["memspec", "auto"])
def test_the_simulator_picks_what_the_daemon_picks(recorded, policy):
    rt, spec, rec = recorded
    rounds = replay_both(rt, spec, rec, policy)
    assert [r[1] for r in rounds] == [r[2] for r in rounds], rounds
    assert len(rounds) > 5 and any(r[1][0] for r in rounds), rounds  # rounds that draft
