"""The decision rule's choice among drafts, shared by the engine, the policies and training."""

from memspec.engine.costs import CostModel, best_choice

COSTS = CostModel(verify_s=[0.02, 0.026, 0.03, 0.032, 0.04], draft_s={"d": 0.01, "e": 0.01})


def test_best_choice_needs_a_draft_that_beats_plain_decoding():
    plain = COSTS.rate(None, 0.0, 0)
    good, poor = COSTS.best_k("d", 0.95, 4), COSTS.best_k("e", 0.1, 4)
    assert best_choice([("d", *good), ("e", *poor)], plain) == ("d", good[0])
    assert best_choice([("e", *poor)], plain) == (None, 0)
    assert best_choice([], plain) == (None, 0)


def test_forced_k_tries_a_draft_the_rule_would_skip():
    assert COSTS.best_k("e", 0.1, 4)[0] == 0
    k, rate = COSTS.best_k("e", 0.1, 4, force=True)
    assert k == 1 and rate == COSTS.rate("e", 0.1, 1)
    assert COSTS.best_k("e", 0.1, 0, force=True)[0] == 0
