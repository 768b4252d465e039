"""Datastore draft: suffix-array index, longest-suffix proposals, byte cap, file round-trip."""

from __future__ import annotations

import time

import numpy as np
import pytest

from memspec.drafts.datastore import (
    SEP,
    BaseMatch,
    DatastoreDraft,
    TrackedContexts,
    _mode,
    _tail_match,
    build_index,
    build_suffix_array,
    load_datastore,
    load_index,
    save_index,
)
from memspec.engine.sampling import SamplingParams
from memspec.errors import ModelLoadError

DOCS = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8], [2, 3, 4, 5, 6, 10], [7, 7, 7]]


def propose(d: DatastoreDraft, ctx: list[int], k: int = 8):
    return d.propose(ctx, k, SamplingParams(), np.random.default_rng(0))


def brute_longest(tokens: np.ndarray, ctx: list[int], max_m: int) -> int:
    arr = tokens.astype(np.int64)
    best = 0
    for m in range(1, max_m + 1):
        windows = np.lib.stride_tricks.sliding_window_view(arr, m)
        if not (windows == np.array(ctx[-m:])).all(axis=1).any():
            break
        best = m
    return best


def test_suffix_array_sorted_to_depth():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 5, size=3000).astype(np.uint32)
    sa = build_suffix_array(tokens, depth=8)
    keys = [tuple(tokens[s : s + 8]) for s in sa]
    assert keys == sorted(keys)  # shorter (cut by the end) sorts first, like bytes
    assert sorted(sa.tolist()) == list(range(len(tokens)))


def test_longest_match_and_most_frequent_path():
    idx = build_index(DOCS)
    m, lo, hi = idx.longest_match([0, 2, 3, 4], 16)
    assert (m, hi - lo) == (3, 3)  # "2 3 4" occurs three times
    # 5 follows twice, 7 once; then 6 twice; then SEP vs 10: 10 (never across documents)
    assert idx.walk(lo, hi, m, 8, 1, 0.0) == [5, 6, 10]
    d = DatastoreDraft("ds", idx, use_context=False, learn=False)
    p = propose(d, [8, 1, 2, 3], 3)
    assert p.tokens == [4, 5, 6] and p.probs is None and p.key == "ds/b3"
    assert propose(d, [8, 1, 2, 3], 1).tokens == [4]
    assert propose(d, [0, 9, 2], 8).tokens == [3, 4, 7, 8]  # one occurrence: up to its end


def test_min_match_and_no_match():
    d = DatastoreDraft("ds", build_index(DOCS), use_context=False, learn=False, min_match=2)
    assert propose(d, [100, 4]).tokens == []  # only a 1-token match: below min_match
    assert propose(d, [100, 101]).tokens == []
    assert propose(d, [3, 4]).tokens  # 2 tokens: proposes


def test_min_share_stops_on_ambiguity():
    d = DatastoreDraft("ds", build_index(DOCS), use_context=False, learn=False, min_share=0.9)
    assert propose(d, [2, 3, 4]).tokens == []  # 5 (2/3) vs 7 (1/3): not confident enough


def test_longest_match_agrees_with_brute_force():
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, 40, size=rng.integers(5, 120))) for _ in range(300)]
    idx = build_index(docs)
    for _ in range(100):
        ctx = [int(t) for t in rng.integers(0, 40, size=12)]
        m, lo, hi = idx.longest_match(ctx, 10)
        assert m == brute_longest(idx.tokens, ctx, 10)
        if m:
            for s in idx.sa[lo:hi]:
                assert idx.tokens[s : s + m].tolist() == ctx[-m:]


def test_longest_match_since_an_earlier_one_is_the_same_match():
    """Grown from the last round's match (a nested search, a bound on m) or searched afresh,
    a growing context gets the same (m, lo, hi): drafts accepted (the match grows), rejected,
    no match at all, the same list asked twice, and a match at max_match."""
    rng = np.random.default_rng(3)
    docs = [list(rng.integers(0, 12, size=rng.integers(5, 200))) for _ in range(200)]
    idx = build_index(docs)
    for trial in range(60):
        src = docs[trial % len(docs)]
        ctx: list[int] = [int(t) for t in rng.integers(0, 12, size=3)]
        since = None
        for _ in range(40):
            j = int(rng.integers(0, 6))  # tokens this round: 0 asks twice at the same length
            if rng.random() < 0.5 and src:  # copy the corpus (long matches), else noise
                at = int(rng.integers(0, len(src)))
                ctx += [int(t) for t in src[at : at + j]]
            else:
                ctx += [int(t) for t in rng.integers(0, 14, size=j)]  # 12, 13: never seen
            for max_match in (4, 16):
                fresh = idx.longest_match(ctx, max_match)
                if max_match == 16:
                    assert idx.longest_match(ctx, 16, since) == fresh
                    since = BaseMatch(len(ctx), *fresh)
                assert fresh[0] == brute_longest(idx.tokens, ctx, min(max_match, len(ctx)))


def test_lookups_of_a_list_grown_in_place_equal_fresh_ones():
    """The draft's memo of each list (array, base match) never changes a proposal: two
    contexts asked in turn, grown, edited and shrunk, against a draft that sees each once."""
    rng = np.random.default_rng(4)
    docs = [list(rng.integers(0, 20, size=rng.integers(20, 300))) for _ in range(100)]
    idx = build_index(docs)
    memo = DatastoreDraft("ds", idx, learn=False)
    ctxs = [list(docs[0][:5]), list(docs[1][:5])]
    for step in range(300):
        ctx = ctxs[step % 2]
        if step % 37 == 36:
            del ctx[-3:]  # edited where the last lookup ended
        src = docs[int(rng.integers(0, len(docs)))]
        at = int(rng.integers(0, len(src)))
        ctx += [int(t) for t in src[at : at + int(rng.integers(1, 5))]]
        fresh = DatastoreDraft("ds", idx, learn=False)
        assert memo.lookup(ctx, 8) == fresh.lookup(list(ctx), 8)


def test_context_match_wins_when_longer():
    idx = build_index(DOCS)
    d = DatastoreDraft("ds", idx, learn=False)
    ctx = [50, 51, 52, 53, 60, 61, 50, 51, 52, 53]  # repeats its own 4-gram
    p = propose(d, ctx, 2)
    assert p.tokens == [60, 61] and p.key == "ds/c4"


def test_recent_outputs_byte_cap_and_learning():
    d = DatastoreDraft("ds", None, use_context=False, recent_bytes=64)
    d.remember([1, 2, 3, 4, 5])  # 5 tokens + separator = 24 bytes
    d.remember([6, 7, 8, 9, 10])
    assert propose(d, [1, 2, 3]).tokens == [4, 5]
    d.remember([11, 12, 13, 14, 15])  # 72 bytes > 64: the oldest goes
    assert d.recent_tokens == 10 and d._recent_used <= 64
    assert propose(d, [1, 2, 3]).tokens == []
    assert propose(d, [6, 7, 8]).tokens == [9, 10]
    d.remember(list(range(100, 200)))  # longer than the cap on its own: its tail is kept
    assert d._recent_used <= 64 and d.recent_tokens == 15

    # The draft learns a finished request's output when the next request starts.
    learner = DatastoreDraft("ds", None, use_context=False, recent_bytes=1 << 16)
    prompt = [900, 901, 902]
    ctx = list(prompt)
    for tok in [30, 31, 32, 33]:
        propose(learner, ctx)
        ctx.append(tok)
    assert learner.recent_tokens == 0
    assert propose(learner, [7, 30, 31]).tokens == [32, 33]  # a new request: learned
    assert learner.recent_tokens == 4


def test_save_load_round_trip(tmp_path):
    idx = build_index(DOCS)
    path = tmp_path / "ds.npz"
    save_index(path, idx, {"source": "x"})
    idx2, meta = load_index(path)
    assert meta["source"] == "x" and meta["n_tokens"] == len(idx)
    assert np.array_equal(idx2.tokens, idx.tokens) and np.array_equal(idx2.sa, idx.sa)
    d = load_datastore("ds", path, {"use_context": 0, "learn": 0})
    assert propose(d, [8, 1, 2, 3], 3).tokens == [4, 5, 6]
    assert d.memory_bytes() >= path.stat().st_size - 4096


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "bad_sa"])
def test_corrupt_file_is_model_load_error(tmp_path, damage):
    path = tmp_path / "ds.npz"
    idx = build_index(DOCS)
    if damage == "bad_sa":
        idx.sa = idx.sa.copy()
        idx.sa[0] = 10_000  # out of range
    save_index(path, idx, {})
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64 + data[64:])
    elif damage == "empty":
        path.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        load_datastore("ds", path)
    with pytest.raises(ModelLoadError):
        load_datastore("ds", tmp_path / "missing.npz")


def test_separator_never_proposed():
    d = DatastoreDraft("ds", build_index([[1, 2, 3], [1, 2, 3]]), use_context=False, learn=False)
    toks = propose(d, [1, 2, 3]).tokens
    assert SEP not in toks and toks == []


def test_propose_is_fast_on_a_realistic_index():
    # ~1M tokens with a Zipf-like vocabulary, like a tokenized corpus.
    rng = np.random.default_rng(0)
    tokens = (rng.zipf(1.3, size=1_000_000) % 49152).astype(np.uint32)
    docs = np.split(tokens, 2000)
    idx = build_index([d.tolist() for d in docs])
    d = DatastoreDraft("ds", idx, learn=False)
    ctxs = [tokens[i : i + 300].tolist() for i in rng.integers(0, len(tokens) - 300, size=200)]
    t = time.perf_counter()
    for c in ctxs:
        propose(d, c, 8)
    per_call = (time.perf_counter() - t) / len(ctxs)
    assert per_call < 2e-3, f"{per_call * 1e3:.2f} ms per proposal"  # typically ~0.2 ms


def test_source_chosen_by_measured_quality_and_gated():
    idx = build_index([[5, 6, 7, 8, 9]])
    table = {"b": [0.0, 0.1, 0.2, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9], "c": [0.0] + [0.6] * 8}
    d = DatastoreDraft("ds", idx, learn=False, meta={"alpha_by_match": table})
    ctx = [5, 6, 7, 42, 6, 7, 5, 6, 7]  # context: "5 6 7" -> 42 (3); corpus: "5 6 7" -> 8 (3)
    p = propose(d, ctx, 1)
    assert p.key == "ds/c3" and p.tokens == [42]  # context matches of 3 are accepted more
    gated = DatastoreDraft(
        "ds", idx, learn=False, use_context=False, min_alpha=0.5, meta={"alpha_by_match": table}
    )
    assert propose(gated, [5, 6, 7]).tokens == []  # b3 accepted 30% < 50%: no proposal
    assert propose(gated, [0, 5, 6, 7, 8]).tokens == [9]  # b4: 90%


def test_calibrate_alpha_measures_acceptance_by_length():
    from memspec.drafts.datastore import calibrate_alpha

    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(0, 30, size=400)]
    docs = [base[i : i + 60] for i in range(0, 340, 20)]  # overlapping: lots of long matches
    table = calibrate_alpha(build_index(docs[1:]), docs[:1])
    assert set(table) == {"b", "c"} and len(table["b"]) == 9
    assert table["b"][8] > 0.9  # the held-out answer is inside the corpus: long matches hit


def test_the_mode_of_a_few_candidates_is_the_sorted_mode():
    """The walk's next token among a few candidates is counted in plain Python: the same
    (token, count) as a sort would give, ties to the smallest token."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 31, 32, 33, 200):
        for _ in range(40):
            col = rng.integers(0, 6, n).astype(np.uint32)
            values, counts = np.unique(col, return_counts=True)
            best = int(np.argmax(counts))
            assert _mode(col) == (int(values[best]), int(counts[best]))


def test_the_tail_match_at_once_is_the_step_by_step_one():
    """Matched in one pass (few candidates) or a step at a time (many): the same (m, ends)."""
    rng = np.random.default_rng(0)
    for size, vocab in ((40, 3), (300, 4), (3000, 2), (50, 50)):
        for _ in range(30):
            arr = rng.integers(0, vocab, size).astype(np.uint32)
            context = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
            for max_match in (1, 4, 16):
                m, ends = _tail_match(arr, context, max_match, at_once=1 << 30)
                m0, ends0 = _tail_match(arr, context, max_match, at_once=0)
                assert m == m0 and ends.tolist() == ends0.tolist()


def test_a_context_grown_in_place_is_converted_once():
    """The engine's list, grown by a few tokens a round, is converted by its new tokens only;
    an edit where the conversion ended, or another list, is converted whole."""
    contexts = TrackedContexts(keep=2)
    ctx = list(range(100))
    first = contexts.array(ctx)
    assert first.dtype == np.uint32 and first.tolist() == ctx
    ctx.extend([7, 8, 9])
    assert contexts.array(ctx).tolist() == ctx
    ctx[-1] = 5  # edited where the last conversion ended
    assert contexts.array(ctx).tolist() == ctx
    del ctx[50:]  # shrunk
    assert contexts.array(ctx).tolist() == ctx
    ctx.extend(range(500, 700))  # grown past its buffer
    assert contexts.array(ctx).tolist() == ctx
    others = [[3, 1, 4], [1, 5, 9]]
    for other in others:
        assert contexts.array(other).tolist() == other
    assert contexts.array(ctx).tolist() == ctx  # forgotten (keep=2) and converted again
