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
