"""Target/draft distributions and the accept/reject rules of speculative sampling.

Greedy (temperature 0) accepts a draft token iff it is the target's argmax. Sampling follows
Leviathan et al. / Chen et al.: accept x ~ q with probability min(1, p(x)/q(x)); on rejection
draw from the residual norm(max(p - q, 0)), which makes the output exactly distributed as p.

The target's distribution p at a position is built in this order (llama.cpp's sampler chain,
but for where the temperature goes):
  1. logit_bias is added to the logits;
  2. penalties, from the tokens before the position (TokenHistory): repeat_penalty over the
     last repeat_last_n context tokens (prompt included; llama.cpp's), then frequency and
     presence penalties over the generated tokens (OpenAI's);
  3. softmax(logits / temperature) (vLLM's and transformers' place; llama.cpp divides last);
  4. top_k, typical_p, top_p, min_p, each renormalized.
Greedy takes the argmax after steps 1-2 (3-4 never change it). Inside a round, position i's
history includes the drafted tokens before it, exactly as if they had been decoded one by one,
so the rows verified together give each position the distribution plain decoding gives it.
A draft's own proposal q only needs steps 3-4 (any q keeps the output exact).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memspec.engine.types import SamplingParams

__all__ = [
    "SamplingParams",
    "TokenHistory",
    "TokenLogprob",
    "accept_draft_token",
    "adjust_logits",
    "probs_from_logits",
    "residual",
    "sample",
    "target_probs",
    "token_logprob",
]


class TokenHistory:
    """What the penalties read at a position: the last repeat_last_n context tokens and how
    often each token was generated. `push` each emitted token; a round's drafted tokens
    before a position are passed as `pending` instead (nothing to undo on rejection)."""

    def __init__(self, params: SamplingParams, prompt: list[int]):
        self.params = params
        n = params.repeat_last_n
        self.window = None if n < 0 else n  # None: the whole context
        self.recent: deque[int] = deque(prompt if n < 0 else prompt[-n:] if n else [], self.window)
        self.counts: dict[int, int] = {}

    def push(self, token: int) -> None:
        self.recent.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1

    def penalize(self, z: np.ndarray, pending: list[int]) -> None:
        """Apply the penalties to float64 logits `z` in place."""
        p = self.params
        if p.repeat_penalty != 1.0 and self.window != 0:
            seen = list(self.recent) + pending
            if self.window is not None:
                seen = seen[-self.window :]
            if seen:
                ids = np.unique(np.asarray(seen, dtype=np.int64))
                v = z[ids]
                # llama.cpp's rule: a positive logit is divided, a negative one multiplied.
                z[ids] = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        if p.presence_penalty or p.frequency_penalty:
            counts = dict(self.counts)
            for t in pending:
                counts[t] = counts.get(t, 0) + 1
            if counts:
                ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
                n = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
                z[ids] -= n * p.frequency_penalty + p.presence_penalty


def adjust_logits(
    logits: np.ndarray,
    params: SamplingParams,
    history: TokenHistory | None = None,
    pending: list[int] | None = None,
) -> np.ndarray:
    """Steps 1-2: the logits (float64, a copy) after logit_bias and the penalties."""
    z = np.array(logits, dtype=np.float64)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias))
        z[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float64, count=len(ids))
    if history is not None:
        history.penalize(z, pending or [])
    return z


def target_probs(
    logits: np.ndarray,
    params: SamplingParams,
    history: TokenHistory | None = None,
    pending: list[int] | None = None,
) -> np.ndarray:
    """The target's distribution at a position (steps 1-4)."""
    if not params.adjusts_logits:
        return probs_from_logits(logits, params)
    return probs_from_logits(adjust_logits(logits, params, history, pending), params)


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Steps 3-4: softmax(logits / T), then top_k, typical_p, top_p and min_p."""
    # One float64 copy of the row, every later step in place on it (each full-vocabulary
    # temporary was an allocation of its own per token); dividing by T = 1 changes no bit.
    z = logits.astype(np.float64)
    if params.temperature != 1.0:
        z /= params.temperature
    z -= z.max()
    p = np.exp(z, out=z)
    p /= p.sum()
    if 0 < params.top_k < len(p):
        p = _keep(p, top_k_order(p, params.top_k))
    if params.typical_p < 1.0:
        p = _keep(p, typical_order(p, params.typical_p))
    if params.top_p < 1.0:
        order = nucleus_order(p, params.top_p)
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, params.top_p) + 1)  # smallest set reaching top_p
        p = _keep(p, order[:keep])
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def _keep(p: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """p restricted to `ids`, renormalized."""
    mask = np.zeros_like(p, dtype=bool)
    mask[ids] = True
    p = np.where(mask, p, 0.0)
    return p / p.sum()


def top_k_order(p: np.ndarray, k: int) -> np.ndarray:
    """The k most likely ids in stable descending order (ties: lower id first), without
    sorting the whole vocabulary."""
    threshold = np.partition(p, len(p) - k)[len(p) - k]
    top = np.flatnonzero(p >= threshold)
    return top[np.argsort(-p[top], kind="stable")][:k]


def typical_order(p: np.ndarray, typical_p: float) -> np.ndarray:
    """Locally typical sampling (llama.cpp's typical_p): ids sorted by how far their
    surprise is from the entropy, the shortest prefix whose mass exceeds typical_p."""
    ids = np.flatnonzero(p)
    logp = np.log(p[ids])
    entropy = -float(np.sum(p[ids] * logp))
    order = ids[np.argsort(np.abs(-logp - entropy), kind="stable")]
    cum = np.cumsum(p[order])
    keep = int(np.searchsorted(cum, typical_p, side="right") + 1)  # first sum > typical_p
    return order[: min(keep, len(order))]


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


# A distribution over more ids than this is drawn from in two steps: a cumsum over a whole
# vocabulary is a serial loop (0.2 ms a draw at 49k ids, 1 ms at 262k), its block sums are not.
SAMPLE_BLOCK = 512


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw of an id from p (one uniform draw). Over a large vocabulary, the block
    of SAMPLE_BLOCK ids holding the draw is found from the blocks' sums first, then the id in
    it: the same id as a whole cumsum's search but where the two round apart (~1e-16)."""
    if len(p) <= SAMPLE_BLOCK:
        i = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))
        return i if i < len(p) else _last_with_mass(p)
    cum = np.cumsum(np.add.reduceat(p, np.arange(0, len(p), SAMPLE_BLOCK)))
    x = rng.random() * cum[-1]
    b = int(np.searchsorted(cum, x, side="right"))
    if b >= len(cum):
        return _last_with_mass(p)
    lo = b * SAMPLE_BLOCK
    block = p[lo : lo + SAMPLE_BLOCK]
    j = int(np.searchsorted(np.cumsum(block), x - (cum[b - 1] if b else 0.0), side="right"))
    return lo + (j if j < len(block) else _last_with_mass(block))


def _last_with_mass(p: np.ndarray) -> int:
    # A draw past the cumsum's end (its rounding) takes the last id that has mass: never one of
    # probability zero (a head's proposal is zero outside its tokens).
    return int(np.flatnonzero(p)[-1])


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


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target's raw distribution (log-softmax
    of its logits: before temperature, penalties or truncation, as OpenAI and vLLM report),
    with the most likely alternatives. Pieces are the tokens' bytes."""

    token: int
    piece: bytes
    logprob: float
    top: list[tuple[int, bytes, float]] = field(default_factory=list)


def token_logprob(
    logits: np.ndarray, token: int, n_top: int, piece: Callable[[int], bytes]
) -> TokenLogprob:
    """`token`'s entry from its position's logits row; piece(id) -> bytes names the tokens."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    top: list[tuple[int, bytes, float]] = []
    if n_top > 0:
        n = min(n_top, len(z))
        for t in top_k_order(z, n).tolist():
            top.append((t, piece(t), float(z[t] - lse)))
    return TokenLogprob(token, piece(token), float(z[token] - lse), top)
