"""Target/draft distributions and the accept/reject rules of speculative sampling.

Greedy (temperature 0) accepts a draft token iff it is the target's argmax. Sampling follows
Leviathan et al. / Chen et al.: accept x ~ q with probability min(1, p(x)/q(x)); on rejection
draw from the residual norm(max(p - q, 0)), which makes the output exactly distributed as p.
"""

from __future__ import annotations

import numpy as np

from memspec.engine.types import SamplingParams

__all__ = ["SamplingParams", "accept_draft_token", "probs_from_logits", "residual", "sample"]


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the user asked for: softmax(logits / T), then the top-p nucleus."""
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = nucleus_order(p, params.top_p)
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, params.top_p) + 1)  # smallest set reaching top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def nucleus_order(p: np.ndarray, top_p: float) -> np.ndarray:
    """A prefix of the stable descending order of p (ties: lower id first) whose mass reaches
    top_p: what top-p keeps, without sorting a whole vocabulary (262k ids: ~20 ms a row).

    Takes the m most likely ids and every id tied with the m-th (so the prefix is exactly the
    full sort's), doubling m until their mass reaches top_p."""
    m = 64
    while m < len(p):
        threshold = np.partition(p, len(p) - m)[len(p) - m]
        top = np.flatnonzero(p >= threshold)  # ascending ids: the stable sort keeps them so
        order = top[np.argsort(-p[top], kind="stable")]
        if p[order].sum() >= top_p:
            return order
        m *= 8
    return np.argsort(-p, kind="stable")


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    # Inverse-CDF draw. A draw past the cumsum's end (its rounding) takes the last token that
    # has mass: never one of probability zero (a head's proposal is zero outside its tokens).
    i = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))
    return i if i < len(p) else int(np.flatnonzero(p)[-1])


def accept_draft_token(
    token: int, p: np.ndarray, q: np.ndarray | None, rng: np.random.Generator
) -> bool:
    """Accept `token` proposed with draft probabilities q (None: a deterministic proposal)."""
    q_x = 1.0 if q is None else float(q[token])
    return q_x > 0 and rng.random() < min(1.0, float(p[token]) / q_x)


def residual(p: np.ndarray, q: np.ndarray | None, token: int) -> np.ndarray:
    """Distribution to sample from after rejecting `token`: norm(max(p - q, 0))."""
    if q is None:  # deterministic proposal: q is a point mass on `token`
        q = np.zeros_like(p)
        q[token] = 1.0
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p
