"""Each policy on synthetic rounds, over the simulator's working set (memspec's rounds through
the Scheduler, as the daemon and the simulator run them)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.types import SamplingParams
from memspec.predictor.model import AcceptancePredictor, KeyModel
from memspec.scheduler.policies import (
    DraftInfo,
    Env,
    OracleEntry,
    Request,
    Round,
    make_policy,
    prompt_key,
)
from memspec.scheduler.rounds import Scheduler
from memspec_lab.sim.simulator import TraceDraft
from memspec_lab.sim.traces import DraftPositions
from memspec_lab.sim.working_set import SimWorkingSet

# GPU-like costs: verification nearly flat in k, drafting cheap.
COSTS = CostModel(
    verify_s=[0.040 + 0.002 * b for b in range(9)],
    draft_s={"good": 0.004, "bad": 0.004, "big": 0.006},
    draft_overhead_s={"lookup": 0.0001},
)
DRAFTS = {
    "good": DraftInfo("good", "model", 100, load_s=0.3),
    "bad": DraftInfo("bad", "model", 100, load_s=0.3),
    "big": DraftInfo("big", "model", 300, load_s=0.8),
    "lookup": DraftInfo("lookup", "prompt_lookup", 0),
}
TRUE_ALPHA = {"good": 0.9, "bad": 0.05, "big": 0.92, "lookup/n3": 0.7}
ENV = Env(DRAFTS, COSTS, k_max=8)
PROMPT = list(range(100, 160))


def working_set(budget: int = 1000, resident=()) -> SimWorkingSet:
    ws = SimWorkingSet(
        budget, {d: i.bytes for d, i in DRAFTS.items()}, {d: i.load_s for d, i in DRAFTS.items()}
    )
    ws.resident = dict.fromkeys(resident, 0.0)
    return ws


def no_peek(draft):
    return f"{draft}/n0", 0


def play(policy, ws, rounds: int, rng: random.Random, peek=no_peek) -> Counter:
    """Synthetic rounds: acceptance drawn from TRUE_ALPHA, seconds from COSTS (+ any stall)."""
    chosen: Counter = Counter()
    policy.begin(Request("r", PROMPT), ws)
    for pos in range(rounds):
        d, k = policy.select_draft(Round(pos, 64, peek), ws)
        stall = 0.0
        if d is not None and d not in ws.resident and not DRAFTS[d].always_resident:
            assert policy.reactive, f"{policy.name} chose non-resident {d}"
            stall = ws.load_now(d)
            if stall is None:  # cannot fit: this round decodes without a draft
                d, k, stall = None, 0, 0.0
        chosen[d] += 1
        key = peek(d)[0] if d == "lookup" else d
        acc = 0
        if d is not None:
            while acc < k and rng.random() < TRUE_ALPHA[key]:
                acc += 1
        seconds = COSTS.round_seconds(d, k) + stall
        policy.record_round(d, key or "", pos, k, acc, seconds, acc + 1)
    policy.end()
    return chosen


def test_none_and_fixed():
    ws = working_set()
    assert make_policy("none", ENV).select_draft(Round(0, 8, no_peek), ws) == (None, 0)
    fixed = make_policy("fixed:bad", ENV)
    chosen = play(fixed, ws, 50, random.Random(0))
    assert set(chosen) == {"bad"}, "a fixed policy drafts with its draft every round"
    assert ws.loads == 1 and ws.stall_s > 0, "first use is a reactive load"


def test_ucb_explores_then_exploits():
    ws = working_set(budget=1000, resident=DRAFTS)
    ucb = make_policy("ucb", ENV)
    rng = random.Random(1)
    play(ucb, ws, len(ucb.arms), rng)
    assert ucb.plays == [1] * len(ucb.arms), "UCB plays every arm once first"
    later = play(ucb, ws, 1500, rng)
    best = later.most_common(1)[0][0]
    assert best in ("good", "big"), later
    assert later[best] > 0.5 * sum(later.values())
    assert later["bad"] < 0.1 * sum(later.values())


def test_exp3_shifts_probability_to_the_best_arms():
    ws = working_set(budget=1000, resident=DRAFTS)
    exp3 = make_policy("exp3", ENV, seed=3)
    rng = random.Random(2)
    early = play(exp3, ws, 200, rng)
    late = play(exp3, ws, 2000, rng)
    share = lambda c, a: c[a] / sum(c.values())  # noqa: E731
    assert share(late, "good") + share(late, "big") > share(early, "good") + share(early, "big")
    assert share(late, "bad") < 0.15


def test_bandit_reactive_loads_stall_under_a_tight_budget():
    ws = working_set(budget=100)  # one small draft at a time
    ucb = make_policy("ucb", ENV)
    play(ucb, ws, 300, random.Random(4))
    assert ws.loads >= 2 and ws.stall_s > 0
    assert ws.peak_bytes <= 100


def predictor_knowing(alphas: dict[str, float]) -> AcceptancePredictor:
    return AcceptancePredictor({k: KeyModel.prior(a) for k, a in alphas.items()})


OUTPUT = list(range(1000, 1300))


def with_drafts(ws: SimWorkingSet, lookup: tuple[str, int] = ("n0", 0)) -> SimWorkingSet:
    """The simulator's trace-backed drafts over OUTPUT: model drafts propose up to k_max
    tokens; the lookup proposes `lookup` (key suffix, tokens) at every position."""
    n = len(OUTPUT)
    for d, info in DRAFTS.items():
        length = [lookup[1]] * n if info.free else [8] * n
        keys = [lookup[0]] * n if info.free else None
        positions = DraftPositions(length, [0] * n, keys)
        ws.drafts[d] = TraceDraft(info, positions, len(PROMPT), OUTPUT, {}, [])
    return ws


def memspec_rounds(pred: AcceptancePredictor, ws: SimWorkingSet, max_tokens: int = 128):
    """memspec's rounds as the daemon and the simulator run them: the Scheduler's."""
    ws = with_drafts(ws) if not ws.drafts else ws
    sched = Scheduler(ws, COSTS, AcceptanceEstimator(), ENV.k_max, clock=lambda: ws.now)
    memspec = make_policy("memspec", ENV, predictor=pred)
    sched.begin_policy(memspec, Request("r", PROMPT, max_tokens=max_tokens))
    return sched, memspec


def choose_at(sched: Scheduler, pos: int) -> tuple[str | None, int]:
    c = sched.choose(PROMPT + OUTPUT[:pos], 64, SamplingParams(), np.random.default_rng(0))
    return (c.draft.id if c.draft is not None and c.k > 0 else None), c.k


def test_memspec_prefers_the_predicted_best_resident_draft():
    pred = predictor_knowing({"good": 0.9, "bad": 0.05, "big": 0.3})
    sched, _ = memspec_rounds(pred, working_set(resident=("good", "bad")))
    d, k = choose_at(sched, 0)
    assert d == "good" and k >= 4
    # Only "bad" resident and it does not pay: plain decoding, never a stall.
    ws2 = working_set(budget=100, resident=("bad",))
    sched2, _ = memspec_rounds(pred, ws2)
    assert choose_at(sched2, 0)[0] != "bad"
    assert ws2.stall_s == 0


def test_memspec_uses_lookup_when_it_has_a_long_match():
    pred = predictor_knowing({"good": 0.3, "lookup/n3": 0.95})
    ws = with_drafts(working_set(resident=("good",)), lookup=("n3", 8))
    sched, _ = memspec_rounds(pred, ws)
    assert choose_at(sched, 10)[0] == "lookup"


def test_memspec_prefetches_by_predicted_value():
    # "big" is a bit better than "good" but three times the bytes and slower to load: with room
    # for one draft, the set holds "good" (more seconds saved, net of the load); with room for
    # everything it holds both (the second loaded between requests); a draft predicted not to
    # pay is never loaded.
    pred = predictor_knowing({"good": 0.9, "bad": 0.05, "big": 0.92})
    ws = working_set(budget=300)
    sched, memspec = memspec_rounds(pred, ws, max_tokens=256)
    assert [ld.draft for ld in ws.queue] == ["good"]
    assert set(memspec.plan) == {"good"}
    assert choose_at(sched, 0)[0] is None, "decoding goes on without waiting for the load"
    ws.advance(1.0)
    assert choose_at(sched, 1)[0] == "good"
    wide = working_set(budget=1000)
    sched, memspec = memspec_rounds(pred, wide, max_tokens=256)
    # While a request decodes, one load at a time (the loader competes for its cores): the
    # best; the rest of the room is filled for later requests once the request ends.
    assert [ld.draft for ld in wide.queue] == ["good"]
    choose_at(sched, 200)  # the request ran 200 tokens
    sched.finish()
    assert sorted(ld.draft for ld in wide.queue) == ["big", "good"]
    assert "bad" not in memspec.plan
    # A much better draft wins the one slot even though a smaller one is denser.
    pred2 = predictor_knowing({"good": 0.55, "bad": 0.05, "big": 0.97})
    ws2 = working_set(budget=300)
    _, memspec2 = memspec_rounds(pred2, ws2, max_tokens=256)
    assert [ld.draft for ld in ws2.queue] == ["big"], memspec2.plan


def test_memspec_learns_online_when_the_prediction_is_wrong():
    pred = predictor_knowing({"good": 0.9, "bad": 0.85, "big": 0.1})
    sched, _ = memspec_rounds(pred, working_set(resident=("good", "bad")))
    TRUE_ALPHA_WRONG = {"good": 0.05, "bad": 0.85}  # the prediction, the wrong way round
    rng = random.Random(5)
    for pos in range(40):
        d, k = choose_at(sched, pos)
        if d is None:
            continue
        a = TRUE_ALPHA_WRONG.get(d, TRUE_ALPHA[d])
        acc = sum(1 for _ in range(k) if rng.random() < a)
        sched.observe(d, k, min(acc, k), 0.05)
    assert choose_at(sched, 41)[0] == "bad"


def test_oracle_follows_its_table():
    table = {prompt_key(PROMPT): OracleEntry("good", {"good": 0.9})}
    oracle = make_policy("oracle", ENV, oracle=table)
    ws = working_set(budget=300)
    oracle.begin(Request("r", PROMPT), ws)
    assert [ld.draft for ld in ws.queue] == ["good"]
    assert oracle.select_draft(Round(0, 64, no_peek), ws) == (None, 0)  # still loading
    ws.advance(1.0)
    d, k = oracle.select_draft(Round(1, 64, no_peek), ws)
    assert d == "good" and k >= 4
    oracle.begin(Request("other", [1, 2, 3]), ws)
    assert oracle.select_draft(Round(0, 64, no_peek), ws) == (None, 0)
    assert oracle.status()["misses"] == 1


def test_policy_decision_is_fast():
    import time

    pred = predictor_knowing({"good": 0.9, "bad": 0.2, "big": 0.9})
    ws = with_drafts(working_set(resident=("good", "bad", "big")), lookup=("n2", 3))
    sched, _ = memspec_rounds(pred, ws, max_tokens=4096)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for pos in range(2000):
        d, k = choose_at(sched, pos % len(OUTPUT))
        if d is not None:
            sched.observe(d, k, int(rng.integers(0, k + 1)), 0.05)
    assert (time.perf_counter() - t) / 2000 < 1e-3


@pytest.mark.models
def test_daemon_policies_are_lossless_and_report_a_broken_predictor(tmp_path):
    """The real runtime: every registered policy reproduces plain decoding; a corrupt
    predictor artifact is a status line, not an outage."""
    from memspec.config import Settings
    from memspec.engine.sampling import SamplingParams
    from memspec.paths import models_dir
    from memspec.runtime import Runtime

    if not (models_dir() / "smollm2-135m-f32.gguf").is_file():
        import pytest

        pytest.fail("testbed missing: run scripts/setup.sh", pytrace=False)
    bad = tmp_path / "broken.json"
    bad.write_text('{"format": "memspec-predictor", "version": 1, "keys": {')
    settings = Settings.load(
        drafts=["prompt-lookup", "q4_0"], n_ctx=512, n_threads=1, budget="950MB", predictor=bad
    )
    rt = Runtime(settings)
    try:
        prompt = rt.requests.prompt_tokens(
            messages=[
                {"role": "user", "content": "Extract the names: Alice met Bob, then Alice left."}
            ]
        )
        params = SamplingParams(max_tokens=24)
        ref = rt.generate(prompt, params, draft="none").token_ids
        for name in ("memspec", "ucb", "exp3", "fixed:q2_k"):
            gen = rt.generate(prompt, params, policy=name)
            assert gen.token_ids == ref, name
        status = rt.memory_status()
        assert status["peak_bytes"] <= status["budget_bytes"]
        pred = status["scheduling"]["predictor"]
        assert pred["loaded"] is False and "broken.json" in pred["error"]
        assert set(status["scheduling"]["policies"]) >= {"memspec", "ucb", "exp3"}
    finally:
        rt.close()


def test_only_lookups_are_peeked_and_only_models_catch_up():
    """A head samples its proposal: asking it before the choice would make what is verified
    depend on what was drawn (inexact sampling) and cost a head run every round."""
    kinds = {"prompt_lookup": (True, False), "datastore": (True, False)}
    kinds |= {"model": (False, True), "head": (False, False)}
    for kind, (peek, catches_up) in kinds.items():
        info = DraftInfo("d", kind, 1)
        assert (info.free, info.catches_up) == (peek, catches_up), kind
