import numpy as np

from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.sampling import SamplingParams


def test_longest_latest_match():
    d = PromptLookupDraft(max_ngram=3)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    tokens, n = d.find(ctx, 3)
    assert n == 3 and tokens == [7, 8, 5]  # the latest earlier occurrence of (1, 2, 3)


def test_no_match_proposes_nothing():
    d = PromptLookupDraft()
    p = d.propose([1, 2, 3, 4], 4, SamplingParams(), np.random.default_rng(0))
    assert p.tokens == [] and p.probs is None
