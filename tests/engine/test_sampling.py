"""The top-p nucleus without a full-vocabulary sort equals the full stable sort's, ties and all."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

from memspec.engine.sampling import (
    SamplingParams,
    at_least,
    draw,
    nucleus_order,
    probs_from_logits,
    residual,
    sample,
)


def full_sort_nucleus(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The definition: the smallest prefix of the softmax's full stable sort (ties: lower id
    first) whose mass reaches top_p, over the softmax probs_from_logits builds."""
    p = probs_from_logits(logits, replace(params, top_p=1.0))
    order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order], dtype=np.float64), params.top_p) + 1)
    return np.sort(order[:keep])


@pytest.mark.parametrize("vocab", [50, 49_152, 262_144])
def test_nucleus_equals_the_full_sort(vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(40):
        logits = (rng.standard_normal(vocab) * rng.choice([0.5, 2.0, 8.0, 30.0])).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits, 1)  # many exact ties, some at the nucleus boundary
        params = SamplingParams(
            temperature=float(rng.choice([0.5, 1.0, 1.5])),
            top_p=float(rng.choice([0.1, 0.5, 0.9, 0.999])),
        )
        p = probs_from_logits(logits, params)
        kept = full_sort_nucleus(logits, params)
        assert np.flatnonzero(p).tolist() == kept.tolist()
        full = probs_from_logits(logits, replace(params, top_p=1.0))
        # pytest.approx's tolerance (rel 1e-6, abs 1e-12), vectorised: approx walks a large
        # nucleus element by element in Python (most of this test's time at 262,144).
        want = full[kept] / full[kept].sum(dtype=np.float64)
        np.testing.assert_allclose(p[kept], want, rtol=1e-6, atol=1e-12)


def test_nucleus_order_is_a_prefix_of_the_stable_sort():
    p = np.array([0.1, 0.3, 0.1, 0.3, 0.2])
    order = nucleus_order(p, 0.5)
    assert order.tolist() == np.argsort(-p, kind="stable")[: len(order)].tolist()
    assert p[order].sum() >= 0.5


def test_a_draw_past_the_end_takes_a_token_with_mass():
    """The inverse-CDF draw can land past the cumsum's end (rounding); it must not return a
    token of probability zero (a head's proposal is zero outside its sub-vocabulary)."""
    from memspec.engine.sampling import sample

    class EdgeRng:  # the largest draw, injected on purpose
        def random(self) -> float:
            return 1.0

    assert sample(np.array([0.25, 0.75, 0.0, 0.0]), EdgeRng()) == 1


def cumsum_draw(p: np.ndarray, u: float) -> int:
    """The definition sample() keeps: the inverse CDF over the whole vocabulary's cumsum."""
    i = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
    return i if i < len(p) else int(np.flatnonzero(p)[-1])


@pytest.mark.parametrize("vocab", [7, 512, 513, 49_152, 151_936])
def test_a_draw_is_the_whole_cumsums_draw(vocab):
    """Drawing through block sums picks the id the whole cumsum picks for the same uniform
    number (they could part only where the two sums round apart, ~1e-16), zeros never."""
    from memspec.engine.sampling import sample

    rng = np.random.default_rng(vocab)
    for trial in range(60):
        z = rng.standard_normal(vocab) * rng.choice([0.5, 3.0, 30.0])
        p = np.exp(z - z.max())
        if trial % 2:  # a truncated distribution: most ids have no mass
            p[rng.random(vocab) < 0.9] = 0.0
            p[int(np.argmax(z))] = 1.0
        p /= p.sum()
        seed = int(rng.integers(1 << 32))
        for _ in range(20):
            u = float(np.random.default_rng(seed).random())
            got = sample(p, np.random.default_rng(seed))
            assert got == cumsum_draw(p, u)
            assert p[got] > 0
            seed += 1


def test_a_draw_never_takes_a_whole_vocabulary_cumsum(monkeypatch):
    """The serial cumsum runs over block sums and one block, never the whole vocabulary."""
    from memspec.engine import sampling

    lengths: list[int] = []

    class CountingNumpy:
        def __getattr__(self, name: str):
            return getattr(np, name)

        @staticmethod
        def cumsum(a, *args, **kwargs):
            lengths.append(len(a))
            return np.cumsum(a, *args, **kwargs)

    monkeypatch.setattr(sampling, "np", CountingNumpy())
    p = np.full(151_936, 1 / 151_936)
    sampling.sample(p, np.random.default_rng(0))
    assert lengths and max(lengths) <= sampling.SAMPLE_BLOCK


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_probs_are_the_softmax_in_float32_and_leave_the_row_alone(temperature):
    logits = np.random.default_rng(1).standard_normal(49_152).astype(np.float32) * 4
    logits.flags.writeable = False  # as llama.cpp's buffer is handed out: read in place
    z = logits.astype(np.float64) / temperature
    want = np.exp(z - z.max())
    want /= want.sum()
    got = probs_from_logits(logits, SamplingParams(temperature=temperature))
    assert got.dtype == np.float32  # llama.cpp's own precision
    assert np.allclose(got, want, rtol=1e-5, atol=0)
    assert got.sum(dtype=np.float64) == pytest.approx(1.0, abs=1e-6)
    assert not np.shares_memory(got, logits)


VOCAB = 151_936  # Qwen2.5's: the bench's target


def row_bytes_at_peak(fn) -> float:
    """The most memory `fn()` held at once (numpy reports its buffers to tracemalloc), in
    float32 rows of VOCAB values: how many full-vocabulary buffers one call needs."""
    fn()  # warm: first-call caches are not the per-token cost
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / (VOCAB * 4)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "fields",
    [
        {},  # the server's defaults: T = 1, no truncation
        {"temperature": 0.7},
        {"temperature": 0.7, "top_k": 40},
        {"temperature": 0.7, "min_p": 0.05},
        {"temperature": 0.7, "top_k": 40, "top_p": 0.95},
    ],
)
def test_a_sampled_token_takes_one_float32_row(fields):
    """A plain sampled token (the distribution, then the draw) builds one float32 row and
    nothing else its size: no float64 copy (8 bytes an id: 2 rows), no temporaries per step,
    no partition of a copied row for top_k; a truncation's boolean mask is a quarter row, the
    cast buffers numpy works through 64 KiB."""
    logits = np.random.default_rng(2).standard_normal(VOCAB).astype(np.float32) * 3
    params = SamplingParams(**({"temperature": 1.0} | fields))
    rng = np.random.default_rng(0)
    assert row_bytes_at_peak(lambda: sample(probs_from_logits(logits, params), rng)) < 1.4


def test_a_rejection_takes_one_more_row():
    """The residual after a deterministic proposal's rejection: one copy of p, no point-mass
    row and no p - q temporary."""
    logits = np.random.default_rng(3).standard_normal(VOCAB).astype(np.float32)
    p = probs_from_logits(logits, SamplingParams(temperature=1.0))
    token = int(np.argmax(p))
    r = residual(p, None, token)
    assert r[token] == 0 and r.sum(dtype=np.float64) == pytest.approx(1.0, abs=1e-6)
    others = np.arange(VOCAB) != token
    assert np.allclose(r[others], p[others] / (1 - p[token]), rtol=1e-5, atol=0)
    assert row_bytes_at_peak(lambda: residual(p, None, token)) < 1.2  # + a 64 KiB cast buffer


@pytest.mark.parametrize("vocab", [50, 4096, 151_936])
def test_at_least_is_a_prefix_of_the_stable_sort(vocab):
    """at_least's guessed threshold keeps at least m ids and cuts the stable descending order
    between two values, ties included (a guess too high is lowered until it does)."""
    rng = np.random.default_rng(vocab)
    for trial in range(30):
        p = rng.standard_normal(vocab).astype(np.float32) * rng.choice([0.5, 3.0, 30.0])
        if trial % 3 == 0:
            p = np.round(p, 1)  # ties
        if trial % 5 == 0:
            p[: vocab // 2] = p.max()  # a sorted run: the strided guess is far off
        m = int(rng.integers(1, vocab))
        top = at_least(p, m)
        assert len(top) >= m and np.all(np.diff(top) > 0)
        order = np.argsort(-p, kind="stable")
        assert sorted(order[: len(top)].tolist()) == top.tolist()


@pytest.mark.parametrize("fields", [{}, {"temperature": 0.7}, {"temperature": 0.7, "top_k": 40}])
def test_draw_is_the_normalised_distributions_draw(fields):
    """draw() skips the normalisation without truncation: the same id for the same uniform
    number (float32 normalisation may round a boundary apart: at most a rare draw differs)."""
    logits = np.random.default_rng(4).standard_normal(VOCAB).astype(np.float32) * 3
    params = SamplingParams(**({"temperature": 1.0} | fields))
    same = sum(
        draw(logits, params, np.random.default_rng(seed))
        == sample(probs_from_logits(logits, params), np.random.default_rng(seed))
        for seed in range(200)
    )
    assert same >= 199


def test_a_plain_draw_takes_one_float32_row():
    logits = np.random.default_rng(5).standard_normal(VOCAB).astype(np.float32)
    rng = np.random.default_rng(0)
    assert row_bytes_at_peak(lambda: draw(logits, SamplingParams(temperature=0.8), rng)) < 1.1


@pytest.mark.parametrize("scale,shift", [(3.0, 0.0), (3.0, 35.0), (3.0, -60.0), (20.0, 200.0)])
def test_unshifted_and_shifted_weights_are_one_softmax(scale, shift):
    """Rows whose max is small skip the shift by the max; large ones (either sign) take it:
    both give the softmax, nothing overflows or vanishes."""
    logits = np.random.default_rng(6).standard_normal(VOCAB).astype(np.float32) * scale + shift
    for temperature in (1.0, 0.5):
        z = logits.astype(np.float64) / temperature
        want = np.exp(z - z.max())
        want /= want.sum()
        got = probs_from_logits(logits, SamplingParams(temperature=temperature))
        assert np.isfinite(got).all()
        big = want > 1e-30  # float32 keeps relative precision down to ~1e-38
        assert np.allclose(got[big], want[big], rtol=2e-5, atol=0)


@pytest.mark.parametrize(
    "scale,shift,temperature,shifted",
    [
        (3.0, 0.0, 1.0, False),  # a real row: drawn unshifted, no pass for the max
        (3.0, 20.0, 0.7, False),
        (3.0, 20.0, 0.2, True),  # a low temperature takes the shift first
        (3.0, 200.0, 1.0, True),  # exp overflows: caught by the total, shifted after all
        (3.0, -120.0, 1.0, True),  # every weight underflows: the same
    ],
)
def test_a_plain_draw_skips_the_max_unless_the_row_needs_it(
    monkeypatch, scale, shift, temperature, shifted
):
    """Without truncation a draw tries exp(logits / T) unshifted (the pass for the max is a
    third of a cold token's cost on a 152k vocabulary); a row whose weights overflow or
    vanish is shifted by its max instead. Either way the draw is the softmax's own, and no
    overflow warning escapes."""
    import warnings

    from memspec.engine import sampling

    logits = np.random.default_rng(7).standard_normal(VOCAB).astype(np.float32) * scale + shift
    params = SamplingParams(temperature=temperature)
    calls = []
    weights = sampling._weights
    monkeypatch.setattr(sampling, "_weights", lambda *a: calls.append(1) or weights(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [draw(logits, params, np.random.default_rng(seed)) for seed in range(100)]
    assert bool(calls) == shifted
    want = [
        sample(probs_from_logits(logits, params), np.random.default_rng(seed))
        for seed in range(100)
    ]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 99


def test_a_point_mass_proposal_is_accepted_on_unnormalised_weights():
    """accept_or_resample (a deterministic draft, no truncation) takes the same decisions as
    the normalised rows' rule for the same uniform numbers, and what it keeps is distributed
    as p: accepted with p(token), else drawn from p without `token`."""
    from memspec.engine.sampling import accept_draft_token, accept_or_resample

    rng0 = np.random.default_rng(8)
    logits = (rng0.standard_normal(1000) * 2).astype(np.float32)
    logits[:3] += 5.0  # a few likely ids, as a real row has
    params = SamplingParams(temperature=0.8)
    p = probs_from_logits(logits, params)
    for token in (0, 1, 500):
        same = 0
        for seed in range(200):
            rng_a, rng_b = np.random.default_rng(seed), np.random.default_rng(seed)
            got = accept_or_resample(token, logits, params, rng_a)
            ok = accept_draft_token(token, p, None, rng_b)
            want = (ok, token if ok else sample(residual(p, None, token), rng_b))
            same += got == want
        assert same >= 199, token
    n = 20_000
    rng = np.random.default_rng(9)
    counts = np.bincount(
        [accept_or_resample(0, logits, params, rng)[1] for _ in range(n)], minlength=len(p)
    )

    # Four bins (the proposed id, the two other likely ones, the rest): noise ~0.005 in TV.
    def binned(x: np.ndarray) -> np.ndarray:
        return np.array([x[0], x[1], x[2], x[3:].sum()])

    tv = 0.5 * np.abs(binned(counts / n) - binned(p)).sum()
    assert tv < 0.02, (tv, binned(p))
