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


def brute_force_find(context: list[int], k: int, max_ngram: int, min_ngram: int):
    """The definition: the latest earlier window equal to the longest tail n-gram."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i : i + n] == tail:
                return context[i + n : i + n + k], n
    return [], 0


def test_incremental_index_equals_a_rescan_as_contexts_grow_and_change():
    rng = np.random.default_rng(0)
    for min_ngram in (1, 2):
        d = PromptLookupDraft(max_ngram=3, min_ngram=min_ngram)
        for _request in range(20):  # a new context each time: the index must start over
            ctx = [int(t) for t in rng.integers(0, 6, rng.integers(1, 30))]
            for _round in range(40):
                assert d.find(ctx, 5) == brute_force_find(ctx, 5, 3, min_ngram)
                ctx = ctx + [int(t) for t in rng.integers(0, 6, rng.integers(1, 4))]


class SliceCountingList(list):
    """A context that records how many tokens each slice of it reads."""

    def __init__(self, tokens: list[int]):
        super().__init__(tokens)
        self.sliced: list[int] = []

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        out = super().__getitem__(key)
        if isinstance(key, slice):
            self.sliced.append(len(out))
        return out


def test_a_context_grown_in_place_costs_no_pass_over_it():
    """The engine appends to one list per request and asks every round: the index checks
    where it ended and adds the new windows, never reading (or copying) the whole context;
    proposals stay those of a rescan."""
    rng = np.random.default_rng(1)
    d = PromptLookupDraft(max_ngram=3)
    ctx = SliceCountingList([int(t) for t in rng.integers(0, 6, 400)])
    d.find(ctx, 5)  # a new request: indexed whole, once
    for _round in range(100):
        ctx.extend(int(t) for t in rng.integers(0, 6, rng.integers(1, 5)))
        ctx.sliced.clear()
        assert d.find(ctx, 5) == brute_force_find(list(ctx), 5, 3, 1)
        assert max(ctx.sliced) <= 8  # the mark, a window, the tail, the continuation
    ctx[-3] = (ctx[-3] + 1) % 6  # an edit where the index ends: it starts over
    assert d.find(ctx, 5) == brute_force_find(list(ctx), 5, 3, 1)
