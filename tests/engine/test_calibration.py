"""Calibration caches: a draft measured after start-up is measured once per machine."""

from __future__ import annotations

import pytest

from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine import calibration
from memspec.engine.costs import CostModel


def test_a_draft_loaded_after_start_up_is_measured_once_then_read_back(
    small_backend, tmp_path, monkeypatch
):
    monkeypatch.setattr(calibration, "cache_dir", lambda: tmp_path)
    draft = PromptLookupDraft()
    first = CostModel(verify_s=[1.0] * 5)
    calibration.measure_draft_cached(small_backend, draft, first, k_max=4)
    measured = first.draft_overhead_s[draft.id]
    assert measured > 0
    assert len(list(tmp_path.glob("calibration-draft-*.json"))) == 1

    def no_forward_passes(*a, **k):
        raise AssertionError("measured again: the cache was not read")

    monkeypatch.setattr(calibration, "measure_draft", no_forward_passes)
    again = CostModel(verify_s=[1.0] * 5)
    calibration.measure_draft_cached(small_backend, draft, again, k_max=4)
    assert again.draft_overhead_s == {draft.id: pytest.approx(measured)}
    assert again.draft_s == {}

    # `memspec calibrate --force` measures every draft again, these included.
    monkeypatch.setattr(calibration, "measure", lambda t, d, k: CostModel(verify_s=[1.0] * 5))
    calibration.calibrate(small_backend, [], 4, force=True)
    assert not list(tmp_path.glob("calibration-draft-*.json"))


def test_a_verify_curve_is_made_non_decreasing():
    # As a cache written on a box losing CPU to steal held it (ms for 1..9 tokens).
    noisy = [39.6, 47.0, 51.5, 58.8, 94.9, 109.8, 75.9, 143.9, 95.0]
    fixed = calibration.non_decreasing(noisy)
    assert all(b >= a for a, b in zip(fixed, fixed[1:], strict=False))
    assert fixed[:4] == noisy[:4]  # what already rose is kept
    assert sum(fixed) == pytest.approx(sum(noisy))  # a falling run becomes its mean
    assert calibration.non_decreasing([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]


def test_measured_verify_costs_rise_with_the_batch(small_backend):
    verify_s = calibration.measure_verify(small_backend, k_max=4)
    assert len(verify_s) == 5
    assert all(b >= a > 0 for a, b in zip(verify_s, verify_s[1:], strict=False))
