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
