from memspec.engine.costs import (
    AcceptanceEstimator,
    CostModel,
    RoundCosts,
    context_band,
    expected_tokens,
)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_decision_rule_prefers_none_when_drafting_loses():
    # CPU-like: verifying 5 tokens costs 2x one step; a draft token costs half a step.
    costs = CostModel(verify_s=[0.02, 0.026, 0.03, 0.032, 0.04], draft_s={"d": 0.01})
    assert costs.best_k("d", 0.1, 4)[0] == 0
    k, rate = costs.best_k("d", 0.95, 4)
    assert k >= 2 and rate > 1 / 0.02


def test_decision_rule_long_drafts_on_gpu_like_costs():
    costs = CostModel(verify_s=[0.02] * 9, draft_s={"d": 0.001})
    assert costs.best_k("d", 0.8, 8)[0] == 8


def test_estimator_moves_toward_observations():
    est = AcceptanceEstimator(prior_alpha=0.5)
    for _ in range(20):
        est.update("a", proposed=4, accepted=4)
        est.update("b", proposed=4, accepted=0)
    assert est.alpha("a") > 0.9 and est.alpha("b") < 0.1
    est.set_prior("c", 0.8)
    assert abs(est.alpha("c/n2") - 0.8) < 1e-9


def test_expected_tokens_with_a_continuation_acceptance():
    # i.i.d. is the special case alpha_cont == alpha.
    assert abs(expected_tokens(0.5, 3, 0.5) - expected_tokens(0.5, 3)) < 1e-12
    # A lookup-like draft: a coin flip to start, then long runs.
    assert abs(expected_tokens(0.5, 4, 1.0) - 3.0) < 1e-12
    assert abs(expected_tokens(0.45, 2, 0.8) - (1 + 0.45 * 1.8)) < 1e-12
    assert expected_tokens(0.9, 0, 0.9) == 1.0


def test_estimator_separates_first_token_and_continuation():
    est = AcceptanceEstimator(prior_alpha=0.5, decay=1.0)
    for _ in range(50):
        est.update("runs", proposed=6, accepted=6)  # right from the start, to the end
        est.update("runs", proposed=6, accepted=0)  # wrong from the start
    assert abs(est.alpha("runs") - 0.5) < 0.02
    assert est.alpha_cont("runs") > 0.98  # once started, never wrong
    # The i.i.d. fit of the same rounds (300 accepted of 350 compared) would say 0.86 for
    # every token: it overrates a round's start and underrates a run's length.
    costs = CostModel(verify_s=[0.020, 0.026, 0.030, 0.031, 0.032, 0.036, 0.038, 0.040, 0.042])
    k_two, _ = costs.best_k("d", est.alpha("runs"), 8, est.alpha_cont("runs"))
    assert k_two >= 5  # a started run is worth verifying long


def _box_costs(**kw) -> CostModel:
    # This box's measured shape: a pass of n tokens over several sequences (ms / 1000).
    batch = {1: 0.044, 2: 0.057, 4: 0.072, 8: 0.104, 16: 0.165, 32: 0.285, 64: 0.536}
    return CostModel(verify_s=[batch[1]] * 9, batch_s=batch, **kw)


def test_batch_rule_drafts_less_per_sequence_as_the_batch_grows():
    from memspec.engine.costs import BatchOption, plan_batch

    costs = _box_costs()
    per_seq = []
    for n in (2, 4, 8, 16):
        ks = plan_batch([BatchOption("lookup", 8, 0.7, 0.8) for _ in range(n)], costs)
        per_seq.append(sum(ks) / n)
    assert per_seq[0] > 0, "two sequences at α 0.7 should draft"
    assert per_seq == sorted(per_seq, reverse=True) and per_seq[-1] < per_seq[0]


def test_batch_rule_never_plans_below_drafting_nothing():
    from memspec.engine.costs import BatchOption, expected_tokens, plan_batch

    costs = _box_costs()
    rng = __import__("random").Random(0)
    for _ in range(200):
        opts = [
            BatchOption("lookup", rng.randint(0, 8), rng.random(), rng.random())
            for _ in range(rng.randint(2, 8))
        ]
        ks = plan_batch(opts, costs)
        assert all(0 <= k <= o.k for k, o in zip(ks, opts, strict=True))
        planned = sum(
            expected_tokens(o.alpha, k, o.alpha_cont) for k, o in zip(ks, opts, strict=True)
        ) / costs.batch(sum(ks) + len(opts))
        assert planned >= len(opts) / costs.batch(len(opts)) - 1e-12
    # Hopeless proposals are not drafted at all.
    assert plan_batch([BatchOption("lookup", 8, 0.01, 0.01)] * 4, costs) == [0, 0, 0, 0]


def test_batch_rule_keeps_serial_drafts_only_where_they_pay():
    from memspec.engine.costs import BatchOption, plan_batch

    costs = _box_costs(draft_s={"q8_0": 0.011})
    model = BatchOption("q8_0", 6, 0.95, 0.95, free=False)
    lookup = BatchOption("lookup", 6, 0.95, 0.95)
    # Beside a sequence drafting as deep, a good caught-up model draft pays.
    assert plan_batch([model, lookup], costs)[0] > 0
    # Beside seven that draft nothing, its serial steps and the extra ubatch do not.
    weak = BatchOption("q8_0", 6, 0.5, 0.5, free=False)
    assert plan_batch([weak] + [BatchOption(None, 0)] * 7, costs)[0] == 0
    # A fixed k (a request's own) is kept as asked.
    assert plan_batch([BatchOption("lookup", 5, fixed=True), BatchOption(None, 0)], costs)[0] == 5


def test_batch_rule_charges_a_serial_drafts_catch_up():
    from memspec.engine.costs import BatchOption, plan_batch

    costs = _box_costs(draft_s={"q8_0": 0.011})
    caught_up = BatchOption("q8_0", 6, 0.95, 0.95, free=False)
    behind = BatchOption("q8_0", 6, 0.95, 0.95, free=False, gap=300)  # a new prompt to feed
    lookup = BatchOption("lookup", 6, 0.95, 0.95)
    assert plan_batch([caught_up, lookup], costs)[0] > 0
    assert plan_batch([behind, lookup], costs)[0] == 0


def test_uneven_ks_cost_an_ubatch_each():
    from memspec.engine.costs import pass_seconds

    costs = _box_costs()
    assert pass_seconds(costs, [1, 1, 1, 1]) == costs.batch(4)
    assert pass_seconds(costs, [3, 1, 1, 1]) == costs.batch(4) + costs.batch(2)
    assert pass_seconds(costs, [3, 3, 3, 3]) == costs.batch(12)


def test_a_dear_first_forward_is_charged_once_per_round():
    """Over a split target the draft's first forward after a verify (which also feeds the
    correction token) cost 46 ms and later steps 19 ms (q8_0, 5 ms links). Charged to every
    drafted token, it held the rule to short drafts at α 0.97 (k = 1 for whole requests)."""
    verify = [0.096, 0.116, 0.121, 0.144, 0.148, 0.167, 0.178, 0.180, 0.211]
    lumped = CostModel(verify_s=verify, draft_s={"d": 0.019})
    split = CostModel(verify_s=verify, draft_s={"d": 0.019})
    for _ in range(40):  # k = 1 rounds: the whole draft time is the first forward
        lumped.observe(RoundCosts("d", 1, 0.046, 1, 0.116))
        split.observe(RoundCosts("d", 1, 0.046, 1, 0.116, first_s=0.046))
    assert lumped.best_k("d", 0.97, 8, 0.9)[0] <= 2
    assert abs(split.round_seconds("d", 3) - (0.046 + 2 * 0.019 + 0.144)) < 1e-3
    assert split.best_k("d", 0.97, 8, 0.9)[0] >= 4
    for _ in range(40):  # k = 4 rounds: later steps learnt from what the first left
        split.observe(RoundCosts("d", 4, 0.046 + 3 * 0.025, 1, 0.148, first_s=0.046))
    assert abs(split.draft_cost("d") - 0.025) < 1e-3
    # Without the first forward's time, rounds are charged per token as before.
    plain = CostModel(verify_s=verify, draft_s={"d": 0.019})
    plain.observe(RoundCosts("d", 2, 0.050, 1, 0.121))
    assert abs(plain.round_seconds("d", 2) - (2 * plain.draft_cost("d") + 0.121)) < 1e-9


def test_context_bands():
    bands = {0: 0, 2047: 0, 2048: 1, 4095: 1, 4096: 2, 16_384: 4, 17_218: 4}
    assert {n: context_band(n) for n in bands} == bands


def test_verify_costs_are_learnt_per_context_band():
    """Gemma 3 270M, calibrated at 128 tokens of context (12.8 ms for one row, 91 for nine),
    decoding at 17k: 21.9 ms for one row, about 215 for nine in use. Scaled by one ratio,
    learnt mostly from one-row rounds, the calibrated curve kept the rule drafting deep at
    17k, and its decoding lost to plain's (26.6 against 21.8 ms a token); learnt in the band,
    the rule stops there, and still drafts at a short context."""
    calibrated = [0.0128, 0.0250, 0.0310, 0.0451, 0.0572, 0.0625, 0.0745, 0.0867, 0.0911]
    costs = CostModel(verify_s=calibrated)
    long = 17_000

    def in_use(rows: int) -> float:  # at 17k, linear: 21.9 ms, then 24.1 a row
        return 0.0219 + 0.0241 * (rows - 1)

    # Nothing measured at 17k yet: the calibrated curve stands in, and the rule drafts.
    assert costs.best_k("pl", 0.99, 8, 0.99, context=long)[0] > 0
    for _ in range(20):
        costs.observe(RoundCosts(None, 0, 0.0, 0, in_use(1), context=long))
    # One row measured: the other sizes keep the calibrated shape, scaled by its ratio.
    assert abs(costs.verify(9, long) - calibrated[8] * in_use(1) / calibrated[0]) < 1e-9
    explored = []
    while (k := costs.best_k("pl", 0.99, 8, 0.99, context=long)[0]) > 0 and len(explored) < 8:
        explored.append(k)
        costs.observe(RoundCosts("pl", k, 0.0, 0, in_use(k + 1), context=long))
    assert explored == [2] and k == 0  # one round explores (3 rows), then no draft pays
    # Between two sizes measured, their excess over calibration is interpolated (attention
    # at a long context adds a cost linear in rows).
    costs.observe(RoundCosts("pl", 8, 0.0, 0, in_use(9), context=long))
    excess_3, excess_9 = in_use(3) - calibrated[2], in_use(9) - calibrated[8]
    between = calibrated[4] + excess_3 + (excess_9 - excess_3) * 2 / 6
    assert abs(costs.verify(5, long) - between) < 1e-9
    # The short band keeps its calibration, and a band measured by nothing borrows the
    # nearest shorter one measured.
    assert costs.verify(9, 500) == calibrated[8]
    assert costs.best_k("pl", 0.99, 8, 0.99, context=500)[0] > 0
    assert costs.verify(9, 40_000) == costs.verify(9, long)
