"""The top-p nucleus without a full-vocabulary sort equals the full stable sort's, ties and all."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.engine.sampling import SamplingParams, nucleus_order, probs_from_logits


def full_sort_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The definition: softmax(logits / T), then the smallest stable-sorted prefix >= top_p."""
    z = logits.astype(np.float64) / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order]), params.top_p) + 1)
    mask = np.zeros_like(p, dtype=bool)
    mask[order[:keep]] = True
    p = np.where(mask, p, 0.0)
    return p / p.sum()


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
        assert np.array_equal(probs_from_logits(logits, params), full_sort_probs(logits, params))


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
def test_probs_are_the_softmax_bit_for_bit_and_leave_the_row_alone(temperature):
    logits = np.random.default_rng(1).standard_normal(49_152).astype(np.float32) * 4
    logits.flags.writeable = False  # as llama.cpp's buffer is handed out: read in place
    z = logits.astype(np.float64) / temperature
    want = np.exp(z - z.max())
    want /= want.sum()
    got = probs_from_logits(logits, SamplingParams(temperature=temperature))
    assert np.array_equal(got, want)
    assert not np.shares_memory(got, logits)
