"""`memspec predictor train` on a synthetic trace: it learns what separates the prompts."""

from __future__ import annotations

import random

from memspec.predictor.model import load_predictor
from memspec_lab.sim.traces import DraftPositions, RunRecord, Trace, TraceRequest
from memspec_lab.sim.train_predictor import TrainConfig, train_from_traces

K_MAX = 8


def positions(match: list[bool]) -> DraftPositions:
    n = len(match)
    run, streak = [0] * n, 0
    for i in range(n - 1, -1, -1):
        streak = streak + 1 if match[i] else 0
        run[i] = min(streak, K_MAX)
    return DraftPositions([min(K_MAX, n - i) for i in range(n)], run)


def synthetic_trace(n_questions: int = 32, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    header = {
        "version": 1,
        "settings": {"k_max": K_MAX, "max_tokens": 64, "target": "t"},
        "drafts": {"m": {"kind": "model", "bytes": 100}},
        "costs": {
            "verify_s": [0.02 + 0.002 * b for b in range(K_MAX + 1)],
            "draft_s": {"m": 0.004},
            "draft_overhead_s": {},
        },
    }
    reqs = []
    for q in range(n_questions):
        extraction = q % 2 == 0
        vocab = range(1000, 1040) if extraction else range(5000, 5040)
        alpha = 0.9 if extraction else 0.2
        prompt = [rng.choice(vocab) for _ in range(50)]
        out = [rng.randrange(100) for _ in range(64)]
        match = [rng.random() < alpha for _ in out]
        reqs.append(
            TraceRequest(
                id=f"q{q}-t1",
                question_id=q,
                category="extraction" if extraction else "writing",
                turn=1,
                prompt=prompt,
                output=out,
                drafts={"m": positions(match)},
                plain=RunRecord(None, 0, 1.0, 0.1, 64, True),
                text="Extract the fields as JSON." if extraction else "Write a poem.",
            )
        )
    return Trace(header, reqs)


def test_training_beats_the_mean_and_separates_categories(tmp_path):
    trace_file = tmp_path / "t.jsonl"
    synthetic_trace().save(trace_file)
    out = tmp_path / "pred.json"
    report = train_from_traces([trace_file], out, TrainConfig(epochs=200, holdout=0.25))
    assert report["alpha_mae"]["m"] < 0.5 * report["baseline_mae"]["m"], report
    assert report["best_draft_agreement"] >= 0.75, report
    pred = load_predictor(out)
    meta = pred.describe()
    assert meta["loaded"] and meta["trained"]["requests"] == 32
    test = synthetic_trace(4, seed=9).requests
    hi = pred.prior_alpha(pred.request(test[0].prompt, test[0].text), "m")
    lo = pred.prior_alpha(pred.request(test[1].prompt, test[1].text), "m")
    assert hi > 0.75 and lo < 0.35, (hi, lo)
