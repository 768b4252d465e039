"""Calibration caches: a draft measured after start-up is measured once per machine; nothing
measured while other processes load the box is cached."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine import calibration
from memspec.engine.costs import CostModel


def test_a_draft_loaded_after_start_up_is_measured_once_then_read_back(
    small_backend, tmp_path, monkeypatch
):
    monkeypatch.setattr(calibration, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(calibration, "BUSY_SHARE", 1.0)  # cached however busy the box is
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


def test_verify_costs_are_measured_at_the_context_asked_for(small_backend, monkeypatch):
    # `bench engine` measures the curve where its long prompts decode: every verify pass
    # appends at that many tokens of cache, and rolls back to it.
    cut_to: list[int] = []
    truncate = small_backend.truncate
    monkeypatch.setattr(small_backend, "truncate", lambda n: (cut_to.append(n), truncate(n)))
    verify_s = calibration.measure_verify(small_backend, k_max=3, context_tokens=200)
    assert len(verify_s) == 4
    assert all(b >= a > 0 for a, b in zip(verify_s, verify_s[1:], strict=False))
    # Every pass rolled back to 200 tokens (0: the resets before and after).
    assert cut_to.count(200) == 4 * (1 + calibration.REPS) and set(cut_to) == {0, 200}


def test_a_calibration_measured_on_a_busy_box_is_used_but_not_cached(
    small_backend, tmp_path, monkeypatch
):
    monkeypatch.setattr(calibration, "cache_dir", lambda: tmp_path)
    with calibration.OthersLoad() as quiet:
        time.sleep(1.0)
    # Another process spinning on every core while we wait: what a test run beside does.
    spin = "import multiprocessing as m, time\n" + (
        "def f():\n    t = time.time()\n    while time.time() - t < 3: pass\n"
        "if __name__ == '__main__':\n    ps = [m.Process(target=f) for _ in range(m.cpu_count())]\n"
        "    [p.start() for p in ps]; [p.join() for p in ps]\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)
        with calibration.OthersLoad() as busy:
            time.sleep(1.0)
    finally:
        proc.wait()
    print(f"others' CPU share: quiet {quiet.share:.2f}, spinning {busy.share:.2f}")
    # (The quiet figure is only printed: the box may be busy with something else already.)
    assert calibration.BUSY_SHARE < busy.share <= 1.1

    # Every measurement counts as busy: the costs are returned, nothing is written.
    monkeypatch.setattr(calibration, "BUSY_SHARE", -1.0)
    costs = calibration.calibrate(small_backend, [PromptLookupDraft()], 2)
    assert len(costs.verify_s) == 3 and costs.draft_overhead_s
    assert not list(tmp_path.glob("calibration-*.json"))

    # ...but this process keeps them: a reload of the model (a switch between models under one
    # budget) measures nothing again, busy or not.
    def no_measure(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("measured again on a reload")

    monkeypatch.setattr(calibration, "measure", no_measure)
    monkeypatch.setattr(calibration, "measure_draft", no_measure)
    again = calibration.calibrate(small_backend, [PromptLookupDraft()], 2)
    assert again.verify_s == costs.verify_s
    assert again.draft_overhead_s == costs.draft_overhead_s
