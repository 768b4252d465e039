import numpy as np

from memspec.drafts.prompt_lookup import PromptLookupDraft, match_bucket
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.policy import DecisionRulePolicy
from memspec.engine.sampling import SamplingParams


def test_unchosen_lookup_proposals_are_scored_for_free():
    """A lookup whose α fell is still scored against the real output, so it can come back."""
    est = AcceptanceEstimator(prior_alpha=0.05)
    for m in range(1, 64):  # the match-length priors too (memspec.drafts.prompt_lookup)
        est.set_prior(f"prompt-lookup/n{match_bucket(m)}", 0.05)
    costs = CostModel(verify_s=[0.02, 0.03, 0.035, 0.04, 0.045])  # drafting pays at high α
    policy = DecisionRulePolicy([PromptLookupDraft(max_ngram=2)], costs, est, k_max=4)
    rng, params = np.random.default_rng(0), SamplingParams()
    pattern = [5, 6, 7, 8, 9]
    ctx = pattern * 2  # the continuation repeats, so lookup would be right every time
    chosen = []
    for _ in range(30):
        choice = policy.choose(ctx, 4, params, rng)
        chosen.append(choice.draft is not None)
        ctx.append(pattern[len(ctx) % len(pattern)])  # the "target" continues the pattern
    assert not chosen[0]  # too pessimistic at first
    assert any(chosen[1:])  # the free shadow scores lifted α until drafting paid
