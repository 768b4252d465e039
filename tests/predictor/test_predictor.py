"""The acceptance predictor: online updates, generalisation by prompt features, artifacts, speed."""

from __future__ import annotations

import json
import random
import time

import pytest

from memspec.predictor.model import (
    AcceptancePredictor,
    KeyModel,
    PredictorError,
    load_or_fallback,
    load_predictor,
)

FAMILY_A = list(range(1000, 1040))  # e.g. "extraction" prompts
FAMILY_B = list(range(5000, 5040))  # e.g. "writing" prompts


def prompt(family: list[int], rng: random.Random, n: int = 60) -> list[int]:
    return [rng.choice(family) for _ in range(n)]


def stream(pred: AcceptancePredictor, state, key: str, alpha: float, rounds: int, rng) -> None:
    """Synthetic verified rounds of k = 4 with per-token acceptance `alpha`."""
    for r in range(rounds):
        acc = 0
        while acc < 4 and rng.random() < alpha:
            acc += 1
        pred.update(state, key, r * 3, proposed=4, accepted=acc)


def test_online_update_moves_estimates_toward_observations():
    rng = random.Random(0)
    pred = AcceptancePredictor.fallback()
    pred.set_prior("good", 0.5)
    pred.set_prior("bad", 0.5)
    tokens = prompt(FAMILY_A, rng)
    state = pred.request(tokens)
    before = {k: pred.alpha(state, k) for k in ("good", "bad")}
    stream(pred, state, "good", 0.95, 20, rng)
    stream(pred, state, "bad", 0.05, 20, rng)
    # Within the request: the posterior follows the rounds.
    assert pred.alpha(state, "good") > before["good"] + 0.3
    assert pred.alpha(state, "bad") < before["bad"] - 0.3
    # Across requests: the model's weights moved too (a new request starts closer).
    fresh = pred.request(prompt(FAMILY_A, rng))
    assert pred.alpha(fresh, "good") > before["good"]
    assert pred.alpha(fresh, "bad") < before["bad"]
    assert pred.online_updates == 40


def test_online_learning_separates_prompt_families():
    """Same draft, different prompts: it learns which prompts it is good on."""
    rng = random.Random(1)
    pred = AcceptancePredictor.fallback()
    pred.online_lr = 0.2
    for _ in range(150):
        fam, alpha = (FAMILY_A, 0.9) if rng.random() < 0.5 else (FAMILY_B, 0.2)
        stream(pred, pred.request(prompt(fam, rng)), "d", alpha, 6, rng)
    a = pred.prior_alpha(pred.request(prompt(FAMILY_A, rng)), "d")
    b = pred.prior_alpha(pred.request(prompt(FAMILY_B, rng)), "d")
    assert a > 0.6 > 0.4 > b, (a, b)


def test_artifact_round_trip(tmp_path):
    rng = random.Random(2)
    pred = AcceptancePredictor.fallback()
    stream(pred, pred.request(prompt(FAMILY_A, rng)), "d", 0.8, 30, rng)
    path = tmp_path / "p.json"
    pred.save(path)
    again = load_predictor(path)
    tokens = prompt(FAMILY_A, rng)
    assert again.prior_alpha(again.request(tokens), "d", 40) == pytest.approx(
        pred.prior_alpha(pred.request(tokens), "d", 40), abs=1e-5
    )
    assert again.describe()["loaded"] is True


def test_missing_or_corrupt_artifact_is_a_clear_error_and_a_safe_fallback(tmp_path):
    with pytest.raises(PredictorError, match="not found"):
        load_predictor(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PredictorError, match="bad.json"):
        load_predictor(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "memspec-predictor", "version": 1, "features": {}}))
    with pytest.raises(PredictorError, match="retrain"):
        load_predictor(wrong)
    pred = load_or_fallback(bad)
    status = pred.describe()
    assert status["loaded"] is False and "bad.json" in status["error"]
    assert status["fallback"]
    pred.set_prior("d", 0.7)
    assert pred.alpha(pred.request([1, 2, 3]), "d") == pytest.approx(0.7, abs=1e-3)


def test_decision_under_one_millisecond():
    """A request's features once, then per round: α for 4 drafts + one online update."""
    rng = random.Random(3)
    pred = AcceptancePredictor({d: KeyModel.prior(0.6) for d in "abcd"})
    tokens = prompt(FAMILY_A + FAMILY_B, rng, n=1500)  # a long multi-turn prompt
    t = time.perf_counter()
    state = pred.request(tokens, "Extract the names and return JSON.", 2)
    per_request = time.perf_counter() - t
    rounds = 2000
    t = time.perf_counter()
    for r in range(rounds):
        for d in "abcd":
            pred.alpha(state, d, r)
        pred.update(state, "a", r, 4, 2)
    per_round = (time.perf_counter() - t) / rounds
    assert per_round < 1e-3, f"{per_round * 1e6:.0f} us per round"
    assert per_request < 5e-3, f"{per_request * 1e3:.2f} ms per request"
