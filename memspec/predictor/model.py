"""The acceptance predictor: α per draft (statistic key) from prompt and generation context.

Per key, a logistic model over the request's sparse prompt features plus a position bucket:

    α_prior(key, request, position) = σ(bias + w · x(request) + v[bucket(position)])

Within a request, the verified rounds so far sharpen it like a Beta posterior whose prior
strength is `prior_weight` pseudo-tokens (decayed so recent rounds count most):

    α = (α_prior · W + accepted) / (W + compared)

Every verified round also takes one small gradient step on the key's weights (online update),
so the model keeps learning in the daemon. Per request the dot products are computed once;
a round then costs a few float operations (< 1 ms per decision by a wide margin).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memspec.errors import MemSpecError
from memspec.predictor.features import (
    FEATURES_VERSION,
    HASH_DIM,
    N_FEATURES,
    N_POS,
    PromptFeatures,
    pos_bucket,
    prompt_features,
)

ARTIFACT_FORMAT = "memspec-predictor"
ARTIFACT_VERSION = 1
_BUCKET = [pos_bucket(i) for i in range(1024)]  # position -> bucket, without a loop per call


class PredictorError(MemSpecError):
    """A predictor artifact is missing, unreadable, or does not match this code."""


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


@dataclass
class KeyModel:
    bias: float
    w: np.ndarray  # N_FEATURES
    pos: list[float] = field(default_factory=lambda: [0.0] * N_POS)

    @classmethod
    def prior(cls, alpha: float) -> KeyModel:
        return cls(logit(alpha), np.zeros(N_FEATURES))


@dataclass
class RequestState:
    """One request's cached prompt part per key and the running counts of its rounds."""

    features: PromptFeatures
    z: dict[str, float] = field(default_factory=dict)
    acc: dict[str, float] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)
    # Online steps along this request's (constant) feature vector, per key: the request's z
    # already includes them; the shared weights get them at flush (before the next request).
    pending: dict[str, float] = field(default_factory=dict)
    a0: dict[str, list[float | None]] = field(default_factory=dict)  # σ(z + pos) per bucket


class AcceptancePredictor:
    def __init__(
        self,
        keys: dict[str, KeyModel],
        prior_weight: float = 4.0,
        decay: float = 0.97,
        online_lr: float = 0.02,
        meta: dict | None = None,
    ):
        self.keys = keys
        self.prior_weight = prior_weight
        self.decay = decay
        self.online_lr = online_lr
        self.meta = meta or {}
        self.priors: dict[str, float] = {}  # per draft id, for keys the artifact lacks
        self.loaded_from: str | None = None
        self.error: str | None = None  # why the artifact could not be used (fallback)
        self.online_updates = 0
        self._features: dict[tuple, PromptFeatures] = {}
        self._open: list[RequestState] = []  # states whose weight steps are not flushed yet

    # --- construction -----------------------------------------------------------------
    @classmethod
    def fallback(cls, error: str | None = None) -> AcceptancePredictor:
        """No artifact: per-kind priors only; it still learns online from every round."""
        p = cls({})
        p.error = error
        return p

    def set_prior(self, draft_id: str, alpha: float) -> None:
        self.priors[draft_id] = alpha

    def model(self, key: str) -> KeyModel:
        m = self.keys.get(key)
        if m is None:
            draft = key.split("/")[0]
            base = self.keys.get(draft)
            if base is not None:  # "draft/state" keys start from the draft's own model
                m = KeyModel(base.bias, base.w.copy(), list(base.pos))
            else:
                m = KeyModel.prior(self.priors.get(draft, 0.5))
            self.keys[key] = m
        return m

    # --- per request ------------------------------------------------------------------
    def request(self, tokens: list[int], text: str = "", turns: int = 1) -> RequestState:
        key = (hash(tuple(tokens)), text, turns)
        feats = self._features.get(key)
        if feats is None:  # replays and retries of a prompt skip the hashing
            feats = prompt_features(tokens, text, turns)
            if len(self._features) >= 512:
                self._features.pop(next(iter(self._features)))
            self._features[key] = feats
        self.flush()
        state = RequestState(feats)
        self._open.append(state)
        return state

    def flush(self) -> None:
        """Apply the online steps of finished (or running) requests to the shared weights."""
        for state in self._open:
            f = state.features
            for key, step in state.pending.items():
                self.model(key).w[f.idx] += step * f.val
            state.pending.clear()
        self._open.clear()

    def prior_alpha(self, state: RequestState, key: str, position: int = 0) -> float:
        b = _BUCKET[position] if position < len(_BUCKET) else N_POS - 1
        cached = state.a0.get(key)
        if cached is not None and cached[b] is not None:
            return cached[b]
        z = state.z.get(key)
        m = self.model(key)
        if z is None:
            z = m.bias + state.features.dot(m.w)
            state.z[key] = z
        a = _sigmoid(z + m.pos[b])
        if cached is None:
            cached = state.a0[key] = [None] * N_POS
        cached[b] = a
        return a

    def alpha(self, state: RequestState, key: str, position: int = 0) -> float:
        """Predicted per-token acceptance now: the prior sharpened by this request's rounds."""
        a0 = self.prior_alpha(state, key, position)
        w = self.prior_weight
        return min((a0 * w + state.acc.get(key, 0.0)) / (w + state.seen.get(key, 0.0)), 0.995)

    def update(
        self, state: RequestState, key: str, position: int, proposed: int, accepted: int
    ) -> None:
        """One verified round: update the request's counts and step the model's weights."""
        if proposed <= 0:
            return
        compared = accepted + (1 if accepted < proposed else 0)
        state.acc[key] = state.acc.get(key, 0.0) * self.decay + accepted
        state.seen[key] = state.seen.get(key, 0.0) * self.decay + compared
        if self.online_lr <= 0:
            return
        # Gradient of the Bernoulli log-likelihood of `compared` trials w.r.t. the logit,
        # normalised by the feature norm (NLMS) so a step has the same size for any prompt.
        m = self.model(key)
        p = self.prior_alpha(state, key, position)
        f = state.features
        step = self.online_lr * (accepted - p * compared) / (f.sq_norm + 2.0)
        state.pending[key] = state.pending.get(key, 0.0) + step
        m.bias += step
        m.pos[pos_bucket(position)] += step
        state.z[key] += step * (f.sq_norm + 1.0)
        state.a0.pop(key, None)
        self.online_updates += 1

    # --- artifact ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        self.flush()
        keys = {}
        for k, m in sorted(self.keys.items()):
            nz = np.flatnonzero(np.abs(m.w) > 1e-6)
            keys[k] = {
                "bias": round(float(m.bias), 6),
                "pos": [round(float(x), 6) for x in m.pos],
                "w": {str(int(i)): round(float(m.w[i]), 6) for i in nz},
            }
        return {
            "format": ARTIFACT_FORMAT,
            "version": ARTIFACT_VERSION,
            "features": {"version": FEATURES_VERSION, "hash_dim": HASH_DIM, "n": N_FEATURES},
            "prior_weight": self.prior_weight,
            "decay": self.decay,
            "online_lr": self.online_lr,
            "keys": keys,
            "meta": self.meta,
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n")
        tmp.replace(path)

    @classmethod
    def from_dict(cls, d: dict) -> AcceptancePredictor:
        if d.get("format") != ARTIFACT_FORMAT or d.get("version") != ARTIFACT_VERSION:
            raise ValueError(
                f"not a {ARTIFACT_FORMAT} v{ARTIFACT_VERSION} artifact "
                f"(format {d.get('format')!r}, version {d.get('version')!r})"
            )
        feats = d.get("features", {})
        if feats.get("version") != FEATURES_VERSION or feats.get("n") != N_FEATURES:
            raise ValueError(
                f"trained with features v{feats.get('version')} (n={feats.get('n')}); this code "
                f"computes v{FEATURES_VERSION} (n={N_FEATURES}): retrain with "
                "`memspec predictor train`"
            )
        keys = {}
        for k, m in d["keys"].items():
            w = np.zeros(N_FEATURES)
            for i, v in m["w"].items():
                w[int(i)] = float(v)
            pos = [float(x) for x in m["pos"]]
            if len(pos) != N_POS:
                raise ValueError(f"key {k!r}: {len(pos)} position weights, expected {N_POS}")
            keys[k] = KeyModel(float(m["bias"]), w, pos)
        return cls(
            keys,
            prior_weight=float(d["prior_weight"]),
            decay=float(d["decay"]),
            online_lr=float(d.get("online_lr", 0.02)),
            meta=d.get("meta", {}),
        )

    def describe(self) -> dict:
        """What status/admin report about the predictor."""
        return {
            "loaded": self.error is None and self.loaded_from is not None,
            "path": self.loaded_from,
            "error": self.error,
            "fallback": "per-kind priors, learning online" if self.error else None,
            "keys": sorted(self.keys),
            "prior_weight": self.prior_weight,
            "online_updates": self.online_updates,
            "trained": {k: self.meta.get(k) for k in ("created", "traces", "requests", "metrics")},
        }


def load_predictor(path: Path) -> AcceptancePredictor:
    """Load an artifact; raise PredictorError naming the file and what is wrong."""
    if not path.is_file():
        raise PredictorError(f"predictor artifact not found: {path}")
    try:
        data = json.loads(path.read_text())
        pred = AcceptancePredictor.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PredictorError(f"predictor artifact {path} is unusable: {e}") from e
    pred.loaded_from = str(path)
    return pred


def load_or_fallback(path: Path | None) -> AcceptancePredictor:
    """The daemon's way: a bad or missing artifact never stops decoding; status says why."""
    if path is None:
        return AcceptancePredictor.fallback("no predictor artifact configured")
    try:
        return load_predictor(path)
    except PredictorError as e:
        return AcceptancePredictor.fallback(e.message)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
