import numpy as np

from memspec.drafts.prompt_lookup import RUN_CAP, PromptLookupDraft, key_match, match_bucket
from memspec.engine.sampling import SamplingParams


def test_longest_latest_match():
    d = PromptLookupDraft(max_ngram=3)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    tokens, m = d.find(ctx, 3)
    assert m == 3 and tokens == [7, 8, 5]  # the latest earlier occurrence of (1, 2, 3)


def test_no_match_proposes_nothing():
    d = PromptLookupDraft()
    p = d.propose([1, 2, 3, 4], 4, SamplingParams(), np.random.default_rng(0))
    assert p.tokens == [] and p.probs is None


def brute_force_find(context: list[int], k: int, max_ngram: int, min_ngram: int):
    """The definition: the copy points are the ends of the earlier windows equal to the
    longest tail n-gram; the match length at one is how far back it equals the tail (capped
    at RUN_CAP). Returns (the match length, the continuations of every copy point with it)."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        runs: dict[int, int] = {}
        for i in range(len(context) - n - 1, -1, -1):
            if context[i : i + n] == tail:
                m = n
                while (
                    m < RUN_CAP
                    and i - 1 - (m - n) >= 0
                    and (context[i - 1 - (m - n)] == context[len(context) - 1 - m])
                ):
                    m += 1
                runs[i + n] = m
        if runs:
            best = max(runs.values())
            return best, [context[e : e + k] for e, m in runs.items() if m == best]
    return 0, [[]]


def agrees(found: tuple[list[int], int], context: list[int], k: int, max_ngram: int, lo: int):
    """A proposal is the continuation of a copy point with the longest match (a match
    followed across rounds may be any of those tied)."""
    tokens, m = found
    best, continuations = brute_force_find(context, k, max_ngram, lo)
    return min(m, RUN_CAP) == best and tokens in continuations


def test_incremental_index_equals_a_rescan_as_contexts_grow_and_change():
    rng = np.random.default_rng(0)
    for min_ngram in (1, 2):
        d = PromptLookupDraft(max_ngram=3, min_ngram=min_ngram)
        for _request in range(20):  # a new context each time: the index must start over
            ctx = [int(t) for t in rng.integers(0, 6, rng.integers(1, 30))]
            for _round in range(40):
                assert agrees(d.find(ctx, 5), ctx, 5, 3, min_ngram)
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
        assert agrees(d.find(ctx, 5), list(ctx), 5, 3, 1)
        assert max(ctx.sliced) <= 8  # the mark, a window, the tail, the continuation
    ctx[-3] = (ctx[-3] + 1) % 6  # an edit where the index ends: it starts over
    assert agrees(d.find(ctx, 5), list(ctx), 5, 3, 1)


# --- the match length, and the k the rule drafts at by it (the module's rule) ---------------

from memspec.engine.costs import AcceptanceEstimator, CostModel  # noqa: E402
from memspec.engine.policy import DecisionRulePolicy  # noqa: E402


def test_match_buckets():
    assert [match_bucket(m) for m in (0, 1, 3, 8, 9, 15, 16, 200, 255, 256, 10_000)] == [
        0, 1, 3, 8, 8, 8, 16, 128, 128, 256, 256,
    ]  # fmt: skip


def test_a_key_says_its_match_length_as_the_proposal_does():
    d = PromptLookupDraft(max_ngram=3)
    p = d.propose([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5], 4, SamplingParams(), None)
    assert (p.key, p.match, p.tokens) == ("prompt-lookup/n5", 5, [9, 1, 2, 3])
    assert key_match(p.key) == p.match  # what the simulator's replay gives the rule
    assert [key_match(k) for k in ("ds/c16", "ds/b16", "ds/r4", "q4_0", "n8", "pl/n")] == [
        16, 0, 0, 0, 0, 0,
    ]  # fmt: skip


def copying(file: list[int], copied: int) -> list[int]:
    """A prompt holding `file`, and an answer that has copied its first `copied` tokens."""
    return [900, 901] + file + [902, 903] + file[:copied]


def test_a_copy_reports_how_far_back_it_matches_and_stays_on_its_source():
    rng = np.random.default_rng(3)
    # A "file" of 300 tokens over a small vocabulary: its 3-grams recur all over it, so the
    # latest occurrence of the tail's 3-gram is seldom the point being copied.
    file = [int(t) for t in rng.integers(0, 12, 300)]
    d = PromptLookupDraft(max_ngram=3, min_ngram=2)
    ctx = copying(file, 40)
    tokens, m = d.find(ctx, 8)
    assert m == 40 and tokens == file[40:48]
    for copied in range(41, 260, 3):  # the answer goes on copying, a few tokens a round
        ctx.extend(file[len(ctx) - len(copying(file, 0)) : copied])
        tokens, m = d.find(ctx, 8)
        assert m == min(copied, len(file)) and tokens == file[copied : copied + 8]
    assert d.propose(ctx, 8, SamplingParams(), np.random.default_rng(0)).key.endswith(
        "/n256"
    )  # 257 tokens


def test_an_edit_breaks_the_match_and_the_copy_finds_its_place_again():
    rng = np.random.default_rng(4)
    file = [int(t) for t in rng.integers(0, 50, 200)]
    d = PromptLookupDraft(max_ngram=3, min_ngram=2)
    ctx = copying(file, 100)
    assert d.find(ctx, 4)[1] == 100
    ctx += [777]  # the edit: a token the file does not have in place of file[100]
    assert d.find(ctx, 4) == ([], 0)
    ctx += file[101:104]  # the copy goes on after the edit: a short match, then longer
    tokens, m = d.find(ctx, 4)
    assert m == 3 and tokens == file[104:108]
    ctx += file[104:120]
    assert d.find(ctx, 4) == (file[120:124], 19)


class FixedLookup(PromptLookupDraft):
    """A lookup whose proposals are given: (tokens, match length) per call."""

    def __init__(self, tokens: list[int], m: int):
        super().__init__("pl")
        self.tokens, self.m = tokens, m

    def find(self, context, k):
        return self.tokens[:k], self.m


# A CPU-like verify curve (SmolLM2 on 2 cores: 30 / 34 / 34 / 45 / 72 ms for 1 / 2 / 3 / 5 / 9).
FLAT = [0.030, 0.034, 0.034, 0.040, 0.045, 0.052, 0.058, 0.065, 0.072]
# A compute-bound one (the 1.5B on 2 cores: 61 / 97 / 133 / 208 / 427 ms): drafting is dear.
STEEP = [0.061, 0.097, 0.133, 0.170, 0.208, 0.262, 0.316, 0.371, 0.427]


def k_chosen(m: int, verify_s: list[float], est: AcceptanceEstimator) -> int:
    rule = DecisionRulePolicy([FixedLookup(list(range(8)), m)], CostModel(verify_s), est, 8)
    return rule.choose(list(range(50)), 32, SamplingParams(), None).k


def learnt(rounds: dict[int, tuple[int, int]]) -> AcceptanceEstimator:
    """Acceptance as rounds of 8-token proposals taught it: match length -> (rounds, the
    tokens each had accepted)."""
    est = AcceptanceEstimator()
    for m, (n, accepted) in rounds.items():
        for _ in range(n):
            est.update(f"pl/n{match_bucket(m)}", 8, accepted)
    return est


def test_k_grows_with_the_match_length_as_its_acceptance_does():
    # Copies (long matches) were accepted whole; 2-token matches at their first token half
    # the time and seldom beyond.
    est = learnt({2: (10, 0), 3: (10, 1), 64: (20, 8), 200: (20, 8)})
    for _ in range(10):
        est.update("pl/n2", 8, 1)
    ks = {m: k_chosen(m, FLAT, est) for m in (2, 3, 64, 200)}
    assert ks[64] == ks[200] == 8  # k_max: a copy is drafted as deep as allowed
    assert ks[2] <= 2 and ks[3] <= 2
    # A match length not seen yet starts from its own prior (16 tokens: 0.89), not from the
    # acceptance of the longer copies.
    assert 0 < k_chosen(16, FLAT, est) < 8


def test_before_any_round_the_prior_grows_with_the_match():
    # A fresh estimator: a long copy is drafted deep from its first round, a 2-token match
    # shallow; and a prior set for a key (a predictor's) is kept.
    assert [k_chosen(m, FLAT, AcceptanceEstimator()) for m in (2, 200)] == [2, 8]
    est = AcceptanceEstimator()
    est.set_prior("pl/n128", 0.1)
    assert k_chosen(200, FLAT, est) == 0 and est.alpha("pl/n128") == 0.1


def test_the_verify_curve_caps_k_where_tokens_per_second_would_drop():
    # The same copy accepted 9 times in 10 at every token: deep where verifying is cheap,
    # shallower where each drafted token costs most of a target step.
    est = AcceptanceEstimator()
    for _ in range(40):
        est.update("pl/n64", 8, 8)
        est.update("pl/n64", 8, 3)
    flat, steep = k_chosen(64, FLAT, est), k_chosen(64, STEEP, est)
    assert 0 < steep < flat
    # And the k chosen is the rate's argmax over what the curve allows.
    costs = CostModel(STEEP)
    a, c = est.alpha("pl/n64"), est.alpha_cont("pl/n64")
    assert (flat, steep) == (
        CostModel(FLAT).best_k("pl", a, 8, c)[0],
        costs.best_k("pl", a, 8, c)[0],
    )


def test_a_datastore_context_copy_reports_its_whole_match():
    from memspec.drafts.datastore import DatastoreDraft

    rng = np.random.default_rng(5)
    file = [int(t) for t in rng.integers(0, 1000, 300)]
    d = DatastoreDraft("ds", None, max_match=16, use_context=True, learn=False)
    p = d.propose(copying(file, 100), 8, SamplingParams(), None)
    # Its search stops at 16 tokens; the copy runs back 100, as the key and match say.
    assert (p.tokens, p.key, p.match) == (file[100:108], "ds/c64", 64)
