"""Offline training of the acceptance predictor from traces (`memspec predictor train`).

Examples are (request, key, position bucket) cells with their accepted and compared token
counts, read from the traces' per-position data: for a model draft each output position is
one comparison (did the draft's next token equal the target's?); for prompt lookup each
position where it proposes is one round's worth (accepted run, plus the rejection if any),
keyed by the n-gram size like the engine does. Each key gets a logistic model fitted by
weighted cross-entropy with L2 (Adam, full batch, numpy). Questions are split into train and
holdout; the holdout measures the error of the per-request α and how often the predicted best
draft (by the decision rule on the trace's own measured costs) is the actual best. The
artifact is then refitted on every question, and the prior strength of the in-request
posterior is picked on the holdout.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from memspec.engine.costs import CostModel, best_choice
from memspec.predictor.features import N_FEATURES, N_POS, pos_bucket, prompt_features
from memspec.predictor.model import AcceptancePredictor, KeyModel, file_digest, now_iso
from memspec_lab.sim.traces import Trace, TraceRequest, load_trace


@dataclass
class TrainConfig:
    epochs: int = 400
    lr: float = 0.05
    l2: float = 1e-2
    holdout: float = 0.25  # share of questions held out for the reported metrics
    seed: int = 0
    decay: float = 0.97
    online_lr: float = 0.02
    prior_weights: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


@dataclass
class Cell:
    request: str
    key: str
    bucket: int
    accepted: float
    compared: float


def key_of(draft: str, keys: list[str] | None, i: int) -> str | None:
    if keys is None:
        return draft
    return f"{draft}/{keys[i]}" if keys[i] else None


def cells_of(req: TraceRequest) -> list[Cell]:
    acc: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for draft, pos in req.drafts.items():
        for i, (length, run) in enumerate(zip(pos.length, pos.run, strict=True)):
            if length <= 0:
                continue
            key = key_of(draft, pos.keys, i)
            if key is None:
                continue
            c = acc[(key, pos_bucket(i))]
            if pos.keys is None:  # model draft: one comparison per position
                c[0] += 1.0 if run > 0 else 0.0
                c[1] += 1.0
            else:  # proposer: the round it would run here
                c[0] += run
                c[1] += run + (1 if run < length else 0)
    return [Cell(req.id, k, b, a, n) for (k, b), (a, n) in acc.items()]


def design(cells: list[Cell], feats: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    x = np.zeros((len(cells), N_FEATURES + N_POS + 1))
    for r, c in enumerate(cells):
        x[r, :N_FEATURES] = feats[c.request]
        x[r, N_FEATURES + c.bucket] = 1.0
        x[r, -1] = 1.0  # bias
    a = np.array([c.accepted for c in cells])
    n = np.array([c.compared for c in cells])
    return x, a, n


def fit_key(x: np.ndarray, a: np.ndarray, n: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """Weighted logistic regression on fractional labels a/n, Adam, full batch."""
    theta = np.zeros(x.shape[1])
    theta[-1] = math.log((a.sum() + 1) / (n.sum() - a.sum() + 1))  # start at the mean
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    total = max(n.sum(), 1.0)
    reg = np.full_like(theta, cfg.l2)
    reg[-1] = 0.0  # no penalty on the bias
    for t in range(1, cfg.epochs + 1):
        p = 1.0 / (1.0 + np.exp(-(x @ theta)))
        g = x.T @ (p * n - a) / total + reg * theta
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        theta -= cfg.lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return theta


def feature_rows(requests: list[TraceRequest]) -> dict[str, np.ndarray]:
    rows = {}
    for r in requests:
        f = prompt_features(r.prompt, r.text, r.turn)
        row = np.zeros(N_FEATURES)
        row[f.idx] = f.val
        rows[r.id] = row
    return rows


def fit(requests: list[TraceRequest], cfg: TrainConfig) -> dict[str, KeyModel]:
    feats = feature_rows(requests)
    by_key: dict[str, list[Cell]] = defaultdict(list)
    for r in requests:
        for c in cells_of(r):
            by_key[c.key].append(c)
    models = {}
    for key, cells in sorted(by_key.items()):
        theta = fit_key(*design(cells, feats), cfg)
        models[key] = KeyModel(
            bias=float(theta[-1]),
            w=theta[:N_FEATURES].copy(),
            pos=[float(x) for x in theta[N_FEATURES : N_FEATURES + N_POS]],
        )
    return models


def request_alpha(req: TraceRequest, key: str) -> tuple[float, float]:
    """The request's actual acceptance for a key: (accepted, compared) over all positions."""
    a = n = 0.0
    for c in cells_of(req):
        if c.key == key:
            a += c.accepted
            n += c.compared
    return a, n


def best_draft(alphas: dict[str, float], costs: CostModel, k_max: int) -> str | None:
    """Which model draft (or none) the decision rule would run for this request."""
    options = ((d, *costs.best_k(d, a, k_max)) for d, a in alphas.items())
    return best_choice(options, costs.rate(None, 0.0, 0))[0]


def _rate(d: str | None, alphas: dict[str, float], costs: CostModel, k_max: int) -> float:
    if d is None:
        return costs.rate(None, 0.0, 0)
    return costs.best_k(d, alphas[d], k_max)[1]


def evaluate(
    pred: AcceptancePredictor, requests: list[TraceRequest], base: dict[str, float], trace: Trace
) -> dict:
    """Holdout error of per-request α (vs. the train mean), and best-draft agreement."""
    errs: dict[str, list[float]] = defaultdict(list)
    base_errs: dict[str, list[float]] = defaultdict(list)
    costs = CostModel(**trace.header["costs"])
    k_max = trace.header["settings"]["k_max"]
    model_drafts = [d for d, info in trace.header["drafts"].items() if info["kind"] == "model"]
    agree = regret_n = 0
    regret = 0.0
    for r in requests:
        state = pred.request(r.prompt, r.text, r.turn)
        actual, predicted = {}, {}
        for key in sorted({c.key for c in cells_of(r)}):
            a, n = request_alpha(r, key)
            if n < 8:
                continue
            # Average the prior over the positions the request actually visited.
            positions = range(len(r.output))
            p = float(np.mean([pred.prior_alpha(state, key, i) for i in positions]))
            errs[key].append(abs(p - a / n))
            base_errs[key].append(abs(base.get(key, 0.5) - a / n))
            if key in model_drafts:
                actual[key], predicted[key] = a / n, p
        if actual:
            want = best_draft(actual, costs, k_max)
            got = best_draft(predicted, costs, k_max)
            agree += want == got
            regret_n += 1

            regret += 1 - _rate(got, actual, costs, k_max) / _rate(want, actual, costs, k_max)
    return {
        "holdout_requests": len(requests),
        "alpha_mae": {k: round(float(np.mean(v)), 4) for k, v in sorted(errs.items())},
        "baseline_mae": {k: round(float(np.mean(v)), 4) for k, v in sorted(base_errs.items())},
        "best_draft_agreement": round(agree / regret_n, 4) if regret_n else None,
        "best_draft_rate_regret": round(regret / regret_n, 4) if regret_n else None,
    }


def posterior_loss(pred: AcceptancePredictor, requests: list[TraceRequest], w: float) -> float:
    """Sequential log-loss of the in-request posterior on model drafts' comparisons."""
    loss, count = 0.0, 0
    for r in requests:
        state = pred.request(r.prompt, r.text, r.turn)
        for d, pos in r.drafts.items():
            if pos.keys is not None:
                continue
            acc = seen = 0.0
            for i, run in enumerate(pos.run):
                a0 = pred.prior_alpha(state, d, i)
                p = min(max((a0 * w + acc) / (w + seen), 1e-4), 1 - 1e-4)
                y = 1.0 if run > 0 else 0.0
                loss -= y * math.log(p) + (1 - y) * math.log(1 - p)
                count += 1
                acc = acc * pred.decay + y
                seen = seen * pred.decay + 1.0
    return loss / max(count, 1)


def train_from_traces(paths: list[Path], out: Path, cfg: TrainConfig) -> dict:
    traces = [load_trace(p) for p in paths]
    requests = [r for t in traces for r in t.requests]
    if not requests:
        raise ValueError("the traces hold no requests")
    questions = sorted({r.question_id for r in requests})
    rng = random.Random(cfg.seed)
    held = set(rng.sample(questions, max(1, int(len(questions) * cfg.holdout))))
    train = [r for r in requests if r.question_id not in held]
    hold = [r for r in requests if r.question_id in held]

    # 1. Fit on the train split, measure on the holdout, pick the posterior's prior strength.
    pred = AcceptancePredictor(fit(train, cfg), decay=cfg.decay, online_lr=cfg.online_lr)
    base: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in train:
        for c in cells_of(r):
            base[c.key][0] += c.accepted
            base[c.key][1] += c.compared
    base_alpha = {k: a / n for k, (a, n) in base.items() if n}
    metrics = evaluate(pred, hold, base_alpha, traces[0]) if hold else {}
    losses = {w: posterior_loss(pred, hold or train, w) for w in cfg.prior_weights}
    prior_weight = min(losses, key=losses.get)
    metrics["posterior_logloss"] = {str(w): round(v, 4) for w, v in losses.items()}

    # 2. Refit on everything for the artifact.
    final = AcceptancePredictor(
        fit(requests, cfg), prior_weight=prior_weight, decay=cfg.decay, online_lr=cfg.online_lr
    )
    final.meta = {
        "created": now_iso(),
        "command": "memspec predictor train --traces "
        + " ".join(str(p) for p in paths)
        + f" --out {out}",
        "config": {**asdict(cfg), "prior_weights": list(cfg.prior_weights)},
        "traces": [
            {"file": p.name, "sha256_16": file_digest(p), "requests": len(t.requests)}
            for p, t in zip(paths, traces, strict=True)
        ],
        "requests": len(requests),
        "question_ids": questions,
        "holdout_question_ids": sorted(held),
        "drafts": {d: info["kind"] for t in traces for d, info in t.header["drafts"].items()},
        "target": traces[0].header["settings"]["target"],
        "metrics": metrics,
    }
    final.save(out)
    return {"out": str(out), "prior_weight": prior_weight, "keys": sorted(final.keys), **metrics}
