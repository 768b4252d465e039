"""A model the caches hold no calibration for is served at once, plain, and calibrated later
a timed pass at a time while no request runs (Runtime(defer_calibration=True), the daemon's):
its first request never waits for calibration, greedy output is plain decoding's before and
after the costs land, and a reload reads the cache (no calibration)."""

from __future__ import annotations

import pytest
from launcher import require_testbed

from memspec.config import Settings
from memspec.engine import calibration
from memspec.engine.costs import BatchOption, CostModel, plan_batch
from memspec.engine.types import SamplingParams

PROMPT = "Extract the names: Alice met Bob and Carol at the station, then Alice and Carol left."


# --- the rule with costs not known yet (no model) --------------------------------------------
def test_unknown_costs_draft_nothing_until_calibrated_costs_are_adopted():
    costs = CostModel.unknown(4)
    assert not costs.known
    # A sure, free draft: with costs alike it would draft as deep as it may.
    assert CostModel.alike(4).best_k("lookup", 0.99, 4)[0] == 4
    assert costs.best_k("lookup", 0.99, 4)[0] == 0
    assert costs.best_k("lookup", 0.99, 4, force=True)[0] == 1  # a policy that must try it
    options = [BatchOption("lookup", 4, 0.99), BatchOption(None, 0), BatchOption("x", 2, 0.5)]
    assert plan_batch(options, costs) == [0, 0, 0]
    fixed = [BatchOption("lookup", 3, 0.2, fixed=True), BatchOption("lookup", 4, 0.99)]
    assert plan_batch(fixed, costs) == [3, 0]  # what a request asked for is kept

    measured = CostModel(verify_s=[0.030, 0.032, 0.034, 0.036, 0.038], draft_overhead_s={"x": 1e-4})
    costs.adopt(measured)
    assert costs.known and costs.verify_s == measured.verify_s and costs.draft_overhead_s
    assert costs.best_k("lookup", 0.99, 4)[0] > 0


# --- one Calibration, stopped and resumed (the real SmolLM2 target) ---------------------------
@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty calibration cache, on disk and in this process."""
    monkeypatch.setattr(calibration, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(calibration, "_measured", {})
    monkeypatch.setattr(calibration, "BUSY_SHARE", 1.0)  # cached however busy the box is
    return tmp_path


@pytest.mark.models
def test_a_calibration_stops_between_passes_and_goes_on_after_a_request(
    small_backend, fresh_cache, monkeypatch
):
    cal = calibration.Calibration(small_backend, k_max=3)
    assert cal.costs is None and cal.done([]) is None  # nothing cached
    budget = iter([False, False, False, True])  # three passes, then a request comes
    assert cal.run([], stop=lambda: next(budget)) is None
    assert cal.passes == 3
    # The request: it takes the target's cache (another context) between two passes.
    small_backend.reset()
    small_backend.eval(small_backend.tokenize("A request between two passes."))
    costs = cal.run([])
    assert costs is not None and cal.passes == 4 * (1 + calibration.REPS)  # none run twice
    assert len(costs.verify_s) == 4
    assert all(b >= a > 0 for a, b in zip(costs.verify_s, costs.verify_s[1:], strict=False))
    assert small_backend.tokens == []  # left empty, as a whole calibration leaves it
    assert list(fresh_cache.glob("calibration-*.json"))

    def no_passes(*_a: object, **_k: object) -> None:
        raise AssertionError("measured again: the cache was not read")

    monkeypatch.setattr(calibration, "target_passes", no_passes)
    again = calibration.Calibration(small_backend, k_max=3).done([])
    assert again is not None and again.verify_s == costs.verify_s


# --- the runtime: served plain first, calibrated while idle, a reload reads the cache ---------
def _settings() -> Settings:
    return Settings.load(drafts=["prompt-lookup"], n_ctx=512, n_threads=2, parallel=1, k_max=3)


def _answer(rt, draft: str) -> tuple[list[int], dict[str, int]]:
    prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": PROMPT}])
    gen = rt.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0), draft=draft)
    return gen.token_ids, dict(gen.drafts_used)


@pytest.mark.models
def test_a_new_model_answers_before_its_calibration_and_the_same_after(fresh_cache, monkeypatch):
    from memspec.runtime import Runtime

    require_testbed()
    events: list[str] = []
    passes = calibration.target_passes

    def recorded(*args: object, **kwargs: object):
        events.append("calibration starts")
        return passes(*args, **kwargs)

    monkeypatch.setattr(calibration, "target_passes", recorded)
    rt = Runtime(_settings(), defer_calibration=True)
    try:
        assert rt.calibration == "calibrating" and not rt.costs.known
        assert rt.memory_status()["calibration"] == "calibrating"
        plain, _ = _answer(rt, "none")
        auto, used = _answer(rt, "auto")
        events.append("first answer")
        assert auto == plain
        assert used == {}  # costs unknown: the rule chose no draft, prompt lookup resident

        # A request comes after two passes: calibration stops there, and goes on later.
        budget = iter([False, False, True])
        assert rt.calibrate_pending(lambda: next(budget)) is False
        assert rt.calibration == "calibrating"
        assert _answer(rt, "auto")[0] == plain
        assert rt.calibrate_pending(lambda: False) is True
        events.append("calibrated")
        assert rt.calibration == "calibrated" and rt.costs.known
        assert "prompt-lookup" in rt.costs.draft_overhead_s  # the resident draft priced too
        assert rt.calibrate_pending(lambda: False) is True  # nothing left
        assert _answer(rt, "auto")[0] == plain  # greedy: the target's own tokens
        assert _answer(rt, "prompt-lookup")[0] == plain
    finally:
        rt.close()
    assert events == ["first answer", "calibration starts", "calibrated"]

    def no_calibration(*_a: object, **_k: object) -> None:
        raise AssertionError("a reload calibrated")

    monkeypatch.setattr(calibration, "target_passes", no_calibration)
    monkeypatch.setattr(calibration, "measure_draft", no_calibration)
    reloaded = Runtime(_settings(), defer_calibration=True)
    try:
        assert reloaded.calibration == "calibrated" and reloaded.costs.known
        assert _answer(reloaded, "auto")[0] == plain
    finally:
        reloaded.close()
