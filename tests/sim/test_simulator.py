"""The trace-driven simulator: fast, never over budget, exact on what the trace says."""

from __future__ import annotations

import time

import pytest

from memspec.scheduler.policies import Policy
from memspec_lab.sim.profile import load_profile
from memspec_lab.sim.simulator import build_setup, policy_for, sim_workload, simulate

POLICIES = ["none", "fixed:q8_0", "fixed:prompt-lookup", "ucb", "exp3", "memspec", "oracle"]


@pytest.fixture(scope="module")
def setup(synthetic_trace):
    return build_setup(synthetic_trace, load_profile("jetson-orin-nano-8gb"))


def test_ten_thousand_requests_in_seconds(synthetic_trace, setup):
    budget = setup.profile.target_bytes + 800_000_000
    workload = sim_workload(synthetic_trace, 10_000, seed=1)
    t, cpu = time.perf_counter(), time.process_time()
    policy = policy_for("memspec", setup, synthetic_trace, predictor=None)
    result = simulate(synthetic_trace, setup, policy, budget, workload)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    assert result["requests"] == 10_000
    print(f"\n10k requests, memspec: {cpu:.1f} s CPU, {wall:.1f} s wall, {result['rounds']} rounds")
    # CPU time: what it costs on a quiet core (wall time on a shared box is noise). Each round
    # is the daemon's Scheduler and decision rule, as live (~15 s here; 3 s when the simulator
    # ran a memoised copy of memspec's choice that no request ran).
    assert cpu < 30, f"{cpu:.1f} s of CPU"


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_never_exceeded(synthetic_trace, setup, policy):
    budget = setup.profile.target_bytes + 600_000_000  # one Jetson-sized model draft
    workload = sim_workload(synthetic_trace, 200, seed=2)
    result = simulate(
        synthetic_trace, setup, policy_for(policy, setup, synthetic_trace), budget, workload
    )
    assert result["peak_bytes"] <= budget
    assert result["tokens"] == sum(len(r.output) for r in workload)


def test_replay_follows_the_trace_exactly(synthetic_trace, setup):
    """fixed draft at k = 1: every round accepts exactly what position data says."""
    r = synthetic_trace.requests[0]
    pd = r.drafts["q8_0"]
    pos, expect_acc, rounds = 0, 0, 0
    while pos < len(r.output):
        a = min(1, pd.run[pos])
        expect_acc += a
        rounds += 1
        pos += min(a + 1, len(r.output) - pos)

    class KOne(Policy):
        name, reactive = "k1", True

        def select_draft(self, rnd, ws):
            return "q8_0", 1

    result = simulate(
        synthetic_trace, setup, KOne(setup.env), setup.profile.target_bytes + 10**9, [r]
    )
    assert result["rounds"] == rounds
    assert result["acceptance"] == pytest.approx(expect_acc / rounds, abs=1e-4)


def test_oracle_knows_the_best_single_draft(synthetic_trace, setup):
    from memspec_lab.sim.simulator import oracle_table

    table = oracle_table(synthetic_trace, setup)
    by_cat = {}
    for r in synthetic_trace.requests:
        from memspec.scheduler.policies import prompt_key

        by_cat.setdefault(r.category, []).append(table[prompt_key(r.prompt)].draft)
    assert set(by_cat["extraction"]) == {"prompt-lookup"}
    assert set(by_cat["writing"]) <= {"q8_0", "q4_0"}


def test_a_self_draft_sharing_the_target_kv_copies_instead_of_catching_up():
    from memspec.drafts.model import DONOR_MIN_TOKENS
    from memspec_lab.sim.profile import DraftCost
    from memspec_lab.sim.simulator import catchup_s

    c = DraftCost(bytes=1, s_per_token=0.01, prefill_s_per_token=0.002, kv_copy_s=0.003)
    prompt = 200
    assert catchup_s(c, prompt, shares_target_kv=False) == pytest.approx(0.002 * prompt)
    assert catchup_s(c, prompt, shares_target_kv=True) == pytest.approx(0.003)
    # Fewer tokens behind than the live draft's threshold: it feeds them itself, as ModelDraft.
    assert catchup_s(c, DONOR_MIN_TOKENS, shares_target_kv=True) == pytest.approx(
        0.002 * DONOR_MIN_TOKENS
    )
    assert catchup_s(c, 2, shares_target_kv=True) == 0.0  # rides on the first draft step
