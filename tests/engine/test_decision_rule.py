"""The decision rule's choice among drafts, shared by the engine, the policies and training."""

from memspec.engine.costs import CostModel, RoundCosts, best_choice

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


# --- the rule follows what rounds measure (regressions for losses seen on held-out prompts) ---

from memspec.engine.costs import AcceptanceEstimator  # noqa: E402
from memspec.engine.policy import DecisionRulePolicy  # noqa: E402
from memspec.engine.types import Draft, Proposal, SamplingParams  # noqa: E402


class BehindDraft(Draft):
    """A model-like draft whose KV cache is `behind` context tokens short (injected state)."""

    kind = "model"

    def __init__(self, behind: int):
        self.id, self.behind = "m", behind

    def propose(self, context, k, params, rng):
        return Proposal(tokens=[0] * k, key=self.id)

    def catchup_tokens(self, context):
        return self.behind


def rule_for(draft: Draft, costs: CostModel, alpha: float = 0.8) -> DecisionRulePolicy:
    est = AcceptanceEstimator()
    est.set_prior(draft.id, alpha)
    return DecisionRulePolicy([draft], costs, est, k_max=4)


def test_a_calibration_taken_on_a_busy_machine_is_corrected_by_measured_rounds():
    # Cached calibration said a single token costs 7 s and a batch of 2 only 0.7 s (written
    # while the box was overloaded): the rule then drafts at any acceptance. Measured rounds
    # (44 ms per token, 53 ms for 2, 70 ms draft step) must bring it back to plain decoding.
    costs = CostModel(verify_s=[7.0, 0.71, 0.65, 0.71, 0.85], draft_s={"m": 0.07})
    rule = rule_for(BehindDraft(0), costs, alpha=0.5)
    ctx, params = [1, 2, 3], SamplingParams()
    assert rule.choose(ctx, 8, params, None).draft is not None  # today's rule: drafts
    for _ in range(3):
        costs.observe(RoundCosts(None, 0, 0.0, 0, 0.044))
        costs.observe(RoundCosts("m", 1, 0.070, 1, 0.053))
    assert abs(costs.verify(1) - 0.044) < 1e-9 and abs(costs.draft_cost("m") - 0.070) < 1e-9
    # An unseen batch: its calibration times the measured ratio, never below a smaller one.
    assert 0.053 <= costs.verify(5) < 0.85 / 10
    assert rule.choose(ctx, 8, params, None).draft is None


def test_a_prompt_catch_up_is_not_taken_for_a_draft_step():
    costs = CostModel(verify_s=[0.02, 0.026, 0.03], draft_s={"m": 0.005})
    # A 194-token catch-up round: not a per-token cost.
    costs.observe(RoundCosts("m", 2, 0.5, 194, 0.026))
    assert costs.draft_cost("m") == 0.005


def test_a_draft_far_behind_the_context_pays_its_catch_up_before_it_is_chosen():
    # A 194-token chat with a short answer: catching the draft up on the prompt costs more than
    # drafting can return over the few tokens left (seen: 0.66x of plain decoding).
    costs = CostModel(verify_s=[0.02, 0.022, 0.024, 0.026, 0.028], draft_s={"m": 0.004})
    ctx, params = list(range(200)), SamplingParams()
    assert rule_for(BehindDraft(2), costs).choose(ctx, 12, params, None).draft is not None
    assert rule_for(BehindDraft(194), costs).choose(ctx, 12, params, None).draft is None
    # ... while over a long answer the same catch-up is worth paying.
    assert rule_for(BehindDraft(194), costs).choose(ctx, 2000, params, None).draft is not None
