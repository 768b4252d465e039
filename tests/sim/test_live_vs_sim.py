"""On the real models: the simulator replays live runs exactly, ranks policies like the live
runner does, and every policy's greedy output is the target's own."""

from __future__ import annotations

import itertools

import pytest

from memspec.config import Settings
from memspec.paths import models_dir
from memspec.scheduler.policies import Policy
from memspec_lab.sim.profile import profile_from_trace
from memspec_lab.sim.simulator import build_setup, simulate
from memspec_lab.sim.traces import collect
from memspec_lab.sim.workload import RequestSpec
from memspec_lab.testbed import select_questions

pytestmark = [pytest.mark.models, pytest.mark.slow]

POLICIES = ["none", "fixed:prompt-lookup", "fixed:q8_0", "ucb", "memspec", "oracle"]
LIVE_ONLY = ["auto"]  # the bare rule over the configured drafts: the simulator has no twin


def settings() -> Settings:
    if not (models_dir() / "smollm2-135m-f32.gguf").is_file():
        pytest.fail("testbed missing: run scripts/setup.sh", pytrace=False)
    # One thread: on a shared 2-core box llama.cpp's spinning threads make 2 much noisier.
    return Settings.load(drafts=["prompt-lookup", "q8_0", "q4_0", "q2_k"], n_ctx=1024, n_threads=1)


class FixedK(Policy):
    """The collector's own runs: one draft, the same k every round."""

    reactive = True

    def __init__(self, env, draft: str, k: int):
        super().__init__(env)
        self.draft, self.k = draft, k

    def select_draft(self, rnd, ws):
        return self.draft, self.k


def test_replay_is_exact_against_measured_runs(tmp_path):
    from memspec.runtime import Runtime

    rt = Runtime(settings())
    try:
        q = select_questions(1, 0, ["extraction"])[0]
        spec = RequestSpec(q["question_id"], q["category"], 1, tuple(q["turns"]))
        trace = collect(rt, [spec], tmp_path / "t.jsonl", max_tokens=32, k_run=4, load_reps=1)
    finally:
        rt.close()
    req = trace.requests[0]
    setup = build_setup(trace, profile_from_trace(trace))
    for draft, run in req.runs.items():
        assert run.identical, f"{draft}: live run differs from plain decoding"
        policy = FixedK(setup.env, draft, 4)
        res = simulate(trace, setup, policy, 10**12, [req])
        live_acc = sum(r.accepted for r in run.rounds)
        live_prop = sum(r.proposed for r in run.rounds)
        assert res["rounds"] == len(run.rounds), draft
        assert res["acceptance"] == pytest.approx(live_acc / live_prop, abs=1e-3), draft


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from memspec_lab.bench.live_policies import run_live
    from memspec_lab.bench.policies import BenchConfig

    out = tmp_path_factory.mktemp("live") / "live.json"
    cfg = BenchConfig(
        mode="live",
        budget="auto",
        per_category=1,
        offset=1,
        categories=["extraction", "writing"],
        turns=2,
        max_tokens=32,
        policies=POLICIES + LIVE_ONLY,
    )
    report = run_live(settings(), cfg, out)
    return report, out.with_suffix(".trace.jsonl")


def test_every_policy_is_lossless_and_within_budget(live):
    report, _ = live
    assert set(report["policies"]) == set(POLICIES + LIVE_ONLY)
    for name, r in report["policies"].items():
        assert r["identical_to_plain"], (name, report["divergences"])
        assert r["peak_bytes"] <= report["budget_bytes"], name
    assert report["policies"]["ucb"]["loads"] >= 1  # it tried the model drafts reactively


def test_simulator_ranks_policies_like_the_live_runner(live):
    from memspec_lab.bench.policies import BenchConfig, bench_sim

    report, path = live
    cfg = BenchConfig(
        mode="sim",
        budget=str(report["budget_bytes"]),
        profile="trace",
        trace=str(path),
        sim_requests=report["requests"],
        policies=POLICIES,
        curve=False,
    )
    sim = bench_sim(cfg)
    live_tps = {n: r["tokens_per_s"] for n, r in report["policies"].items() if n in POLICIES}
    sim_tps = {n: r["tokens_per_s"] for n, r in sim["policies"].items()}
    print("\nlive", live_tps, "\nsim ", sim_tps)
    clear = 0
    for a, b in itertools.combinations(POLICIES, 2):
        ratio = sim_tps[a] / sim_tps[b]
        # Too close to call: four 32-token requests on a shared 2-core box. In CI a policy's live
        # rate has come out 10-20% under its own replay of the same trace (plain decoding 16.8
        # vs 18.6 tokens/s, the oracle 18.3 vs 22.9), so only a gap of 25% or more is a ranking.
        if abs(ratio - 1) < 0.25:
            continue
        clear += 1
        assert (live_tps[a] > live_tps[b]) == (ratio > 1), (a, b, live_tps, sim_tps)
    assert clear >= 3, "the policies should differ clearly on this workload"
