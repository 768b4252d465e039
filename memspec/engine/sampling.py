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

import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from memspec.engine.types import SamplingParams

if TYPE_CHECKING:
    from memspec.engine.grammar import GrammarState

# The dtype of the rows the distributions are built in (llama.cpp's logits are float32).
LOGIT_DTYPE = np.float32

__all__ = [
    "SamplingParams",
    "TokenHistory",
    "TokenLogprob",
    "accept_draft_token",
    "accept_rows",
    "accept_or_resample",
    "adjust_logits",
    "draw",
    "probs_from_logits",
    "residual",
    "sample",
    "target_probs",
    "token_logprob",
    "truncates",
    "weights",
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
        """Apply the penalties to logits `z` (adjust_logits' float32 copy) in place."""
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
    """Steps 1-2: the logits (float32, a copy) after logit_bias and the penalties."""
    z = np.array(logits, dtype=LOGIT_DTYPE)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias))
        z[ids] += np.fromiter(params.logit_bias.values(), dtype=LOGIT_DTYPE, count=len(ids))
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
    """Steps 3-4: softmax(logits / T), then top_k, typical_p, top_p and min_p (float32)."""
    # One float32 row, every later step in place on it: a float64 copy and softmax cost twice
    # the memory traffic and exp's time per token, for precision the draw never sees (llama.cpp
    # samples in float32 too). A whole row's sum is numpy's pairwise one (~1e-7 relative in
    # float32); the running sums a draw searches are float64.
    p, cum = weights(logits, params)
    p *= LOGIT_DTYPE(1.0 / cum[-1])  # the block sums' total: no pass of its own
    support = None  # the ids an earlier filter kept (the rest have no mass)
    if 0 < params.top_k < len(p):
        support = top_k_order(p, params.top_k)
        _keep(p, support)
    if params.typical_p < 1.0:
        support = typical_order(p, params.typical_p)
        _keep(p, support)
    if params.top_p < 1.0:
        order = nucleus_order(p, params.top_p, None if support is None else np.sort(support))
        cum = np.cumsum(p[order], dtype=np.float64)
        keep = int(np.searchsorted(cum, params.top_p) + 1)  # smallest set reaching top_p
        _keep(p, order[:keep])
    if params.min_p > 0.0:
        p[p < LOGIT_DTYPE(params.min_p) * p.max()] = 0.0
        p *= LOGIT_DTYPE(1.0 / float(p.sum()))
    return p


# |max logit / T| up to which the weights are exp(logits / T) unshifted: their sum stays far
# from float32's overflow (e^40 a token), and what underflows (below e^-103) weighs under
# e^-63 of the top token. Real rows' largest logits are ~10-30.
UNSHIFTED_MAX = 40.0
MIN_TOP_WEIGHT = math.exp(-UNSHIFTED_MAX)


def _weights(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """softmax(logits / T) but for its normalisation, a new float32 row: exp(logits / T),
    shifted by the max first when the max is large (a pass saved when it is not)."""
    inv_t = 1.0 / params.temperature
    m = float(np.max(logits))
    if abs(m * inv_t) <= UNSHIFTED_MAX:
        z = np.multiply(logits, inv_t, dtype=LOGIT_DTYPE) if inv_t != 1.0 else None
        return np.exp(logits if z is None else z, out=z, dtype=LOGIT_DTYPE)
    z = np.subtract(logits, m, dtype=LOGIT_DTYPE)
    if inv_t != 1.0:
        z *= LOGIT_DTYPE(inv_t)
    return np.exp(z, out=z)


def truncates(params: SamplingParams) -> bool:
    """Whether step 4 cuts anything (top_k, typical_p, top_p, min_p)."""
    return params.top_k > 0 or params.typical_p < 1.0 or params.top_p < 1.0 or params.min_p > 0


# weights() tries exp(logits / T) with no shift at all (no pass for the max) when T >= this:
# no real row's largest logit (~10-30) then nears float32's exp limit (88 at logit / T). A row
# that breaks it shows in its total (inf, or too small to trust) and is shifted after all.
UNSHIFTED_FIRST_T = 0.5


def weights(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """softmax(logits / T) unnormalised, a new float32 row, and its block_cumsum (whose last
    value is the total): what a draw without truncation needs, two passes over the row fewer
    than normalising (unshifted where the temperature allows: a third)."""
    if params.temperature >= UNSHIFTED_FIRST_T:
        inv_t = 1.0 / params.temperature
        z = np.multiply(logits, inv_t, dtype=LOGIT_DTYPE) if inv_t != 1.0 else None
        with np.errstate(over="ignore"):  # an overflow (exp's, or a block sum's) shows in
            w = np.exp(logits if z is None else z, out=z, dtype=LOGIT_DTYPE)  # the total
            cum = block_cumsum(w)
        # The top weight is at least total / n: above e^-UNSHIFTED_MAX, nothing that mattered
        # underflowed (the bound the shift's skip keeps in _weights).
        if len(w) * MIN_TOP_WEIGHT <= cum[-1] < np.inf:
            return w, cum
    w = _weights(logits, params)
    return w, block_cumsum(w)


def draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """sample(probs_from_logits(logits, params), rng): the same draw for the same uniform
    number (but where float32 normalisation rounds apart). Without truncation the weights are
    drawn from unnormalised (sample scales its uniform number by their sum)."""
    if truncates(params):
        return sample(probs_from_logits(logits, params), rng)
    w, cum = weights(logits, params)
    return sample(w, rng, cum)


def accept_or_resample(
    token: int, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[bool, int]:
    """accept_draft_token and, on a rejection, the residual's draw, for a deterministic
    proposal (q a point mass on `token`) without truncation, on unnormalised weights: accept
    with p(token) = w(token) / total, else draw from w without `token`. The same uniform
    numbers, in the same order, as the normalised rows' rule."""
    w, cum = weights(logits, params)
    if rng.random() < float(w[token]) / cum[-1]:
        return True, token
    w[token] = 0.0  # the residual: p but at `token`, where p(token) - 1 <= 0
    return False, sample(w, rng) if w.any() else token


def _keep(p: np.ndarray, ids: np.ndarray) -> None:
    """Restrict p to `ids` and renormalize, in place (ids: a few, out of a vocabulary)."""
    kept = p[ids]
    p.fill(0.0)
    p[ids] = kept * (1.0 / kept.sum(dtype=np.float64))


def top_k_order(p: np.ndarray, k: int) -> np.ndarray:
    """The k most likely ids in stable descending order (ties: lower id first), without
    sorting the whole vocabulary."""
    top = at_least(p, k)
    return top[np.argsort(-p[top], kind="stable")][:k]


# at_least's guess of its threshold reads one id in this many (at most), so that the guess
# costs a partition of a few thousand values, not of the whole vocabulary.
GUESS_STRIDE = 64


def at_least(p: np.ndarray, m: int) -> np.ndarray:
    """The ascending ids of every value >= some threshold that at least m values reach: a
    superset of the m largest and of every value tied with the m-th, hence a prefix of the
    stable descending order. The threshold is guessed from a strided subsample's order
    statistic (~4m ids pass it); a guess too high is lowered, down to the exact m-th value."""
    n = len(p)
    if m >= n:
        return np.arange(n)
    stride = min(GUESS_STRIDE, max(n // (4 * m), 1))
    guess = p[::stride]
    j = 4 * m // stride + 4  # the subsample's j-th largest: ~4m values above it in p
    while j < len(guess):
        top = np.flatnonzero(p >= np.partition(guess, len(guess) - j)[len(guess) - j])
        if len(top) >= m:
            return top
        j *= 4
    return np.flatnonzero(p >= np.partition(p, n - m)[n - m])


def typical_order(p: np.ndarray, typical_p: float) -> np.ndarray:
    """Locally typical sampling (llama.cpp's typical_p): ids sorted by how far their
    surprise is from the entropy, the shortest prefix whose mass exceeds typical_p."""
    ids = np.flatnonzero(p)
    logp = np.log(p[ids])
    entropy = -float(np.sum(p[ids] * logp, dtype=np.float64))
    order = ids[np.argsort(np.abs(-logp - entropy), kind="stable")]
    cum = np.cumsum(p[order], dtype=np.float64)
    keep = int(np.searchsorted(cum, typical_p, side="right") + 1)  # first sum > typical_p
    return order[: min(keep, len(order))]


def nucleus_order(p: np.ndarray, top_p: float, support: np.ndarray | None = None) -> np.ndarray:
    """A prefix of the stable descending order of p (ties: lower id first) whose mass reaches
    top_p: what top-p keeps, without sorting a whole vocabulary (262k ids: ~20 ms a row).

    Takes a prefix holding the m most likely ids and every id tied with the m-th (at_least),
    growing m until its mass reaches top_p. Ids of no mass never end the nucleus, so they are
    left out: `support` (ascending ids), when given, holds every id with mass (after top_k)."""
    if support is not None:
        return support[np.argsort(-p[support], kind="stable")]
    m = 64
    while m < len(p):
        top = at_least(p, m)  # ascending ids: the stable sort keeps them so
        if not p[top].all():  # the threshold reached 0: the support is prefix enough
            top = np.flatnonzero(p)
        order = top[np.argsort(-p[top], kind="stable")]
        if p[order].sum(dtype=np.float64) >= top_p:
            return order
        m *= 8
    return np.argsort(-p, kind="stable")


# A distribution over more ids than this is drawn from in two steps: a cumsum over a whole
# vocabulary is a serial loop (0.2 ms a draw at 49k ids, 1 ms at 262k), its block sums are not.
SAMPLE_BLOCK = 512


@functools.lru_cache(maxsize=8)
def _block_starts(n: int) -> np.ndarray:
    starts = np.arange(0, n, SAMPLE_BLOCK)
    starts.flags.writeable = False  # shared by every draw over n ids
    return starts


def block_cumsum(p: np.ndarray) -> np.ndarray:
    """The running float64 sums of p's blocks of SAMPLE_BLOCK ids (each block's own sum in
    p's dtype: a pairwise sum, float32's error ~1e-7 of the block's mass)."""
    return np.cumsum(np.add.reduceat(p, _block_starts(len(p))), dtype=np.float64)


def sample(p: np.ndarray, rng: np.random.Generator, cum: np.ndarray | None = None) -> int:
    """Inverse-CDF draw of an id from p (one uniform draw). Over a large vocabulary, the block
    of SAMPLE_BLOCK ids holding the draw is found from the blocks' sums first (`cum`, when
    the caller has them: block_cumsum(p)), then the id in it: the same id as a whole cumsum's
    search but where the two round apart (~1e-16 for a float64 p). The running sums are
    float64 whatever p's dtype."""
    if len(p) <= SAMPLE_BLOCK:
        x = rng.random() * p.sum(dtype=np.float64)
        i = int(np.searchsorted(np.cumsum(p, dtype=np.float64), x, side="right"))
        return i if i < len(p) else _last_with_mass(p)
    if cum is None:
        cum = block_cumsum(p)
    x = rng.random() * cum[-1]
    b = int(np.searchsorted(cum, x, side="right"))
    if b >= len(cum):
        return _last_with_mass(p)
    lo = b * SAMPLE_BLOCK
    block = p[lo : lo + SAMPLE_BLOCK]
    x -= cum[b - 1] if b else 0.0
    j = int(np.searchsorted(np.cumsum(block, dtype=np.float64), x, side="right"))
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
    if q is None:  # deterministic proposal: q is a point mass on `token`, so p - q is p
        r = p.copy()  # but at `token`, where it is p(token) - 1 <= 0
        r[token] = 0.0
    else:
        r = np.subtract(p, q)
        np.maximum(r, 0.0, out=r)
    total = float(r.sum())
    if total <= 0:
        return p
    r *= 1.0 / total
    return r


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
    ids = top_k_order(z, min(n_top, len(z))).tolist() if n_top > 0 else []
    top = [(t, piece(t), float(z[t] - lse)) for t in ids]
    return TokenLogprob(token, piece(token), float(z[token] - lse), top)


def accept_rows(
    logits: np.ndarray,
    drafted: list[int],
    q: list[np.ndarray] | None,
    params: SamplingParams,
    rng: np.random.Generator,
    grammar: GrammarState | None = None,
    history: TokenHistory | None = None,
) -> list[int]:
    """The accept rule on whole rows (row i scores drafted[i], one more row the target's own
    next token): the drafted tokens kept, then the target's. `q`: the draft's distribution
    per drafted token (None: a point mass). Row i is adjusted (logit_bias, penalties over
    `history` and drafted[:i], as plain decoding sees them) and masked by the grammar in its
    state after the tokens kept so far; the grammar advances on each token kept, never on a
    rejected one. Rows after the first rejection are never read."""

    def row(i: int) -> np.ndarray:
        z = logits[i]
        if params.adjusts_logits:
            z = adjust_logits(z, params, history, drafted[:i])
        return z if grammar is None or params.greedy else grammar.mask(z)

    def keep(tok: int) -> int:
        if grammar is not None:
            grammar.accept(tok)
        return tok

    def greedy(i: int) -> int:
        if grammar is None:
            return int(np.argmax(row(i)))
        return keep(grammar.greedy(row(i)))

    new: list[int] = []
    for i, tok in enumerate(drafted):
        if params.greedy:  # the argmax among what the grammar allows; kept as it is chosen
            choice = greedy(i)
            if choice != tok:
                return new + [choice]
            new.append(tok)
            continue
        # Sampling: accept with min(1, p/q), else draw from norm(max(p - q, 0)).
        qi = q[i] if q else None
        if qi is None and not truncates(params):  # a point mass: unnormalised weights do
            accepted, resampled = accept_or_resample(tok, row(i), params, rng)
        else:
            p = probs_from_logits(row(i), params)
            accepted = accept_draft_token(tok, p, qi, rng)
            resampled = tok if accepted else sample(residual(p, qi, tok), rng)
        if not accepted:
            return new + [keep(resampled)]
        new.append(keep(tok))
    bonus = len(drafted)
    return new + [greedy(bonus) if params.greedy else keep(draw(row(bonus), params, rng))]
