"""A draft that is a (smaller or quantized) language model behind the Backend interface."""

from __future__ import annotations

import time

import numpy as np

from memspec.backends.base import Backend, common_prefix
from memspec.engine.sampling import SamplingParams, probs_from_logits, sample
from memspec.engine.types import Draft, Proposal


class ModelDraft(Draft):
    kind = "model"

    def __init__(self, id: str, backend: Backend, min_confidence: float = 0.3):
        self.id = id
        self.backend = backend
        # Stop drafting once the draft's own top probability falls below this: an unsure
        # token is likely rejected and would waste the remaining draft steps. Only the
        # proposal's length changes, so this cannot affect the output.
        self.min_confidence = min_confidence

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        if k <= 0:
            return Proposal(key=self.id)
        be = self.backend
        # Catch up: keep the shared prefix (rejected candidates are truncated away), then feed
        # what is new since last round — usually just the target's correction token.
        kept = be.reuse_prefix(context[:-1])
        room = be.n_ctx - len(context)
        k = min(k, room)
        if k <= 0:
            return Proposal(key=self.id)
        t = time.perf_counter()
        # Views of the draft's logits buffer (no copy): each is read before the next eval.
        logits = be.eval(context[kept:], all_logits=False, copy=False)[-1]
        catchup_s = time.perf_counter() - t
        tokens: list[int] = []
        probs: list[np.ndarray] | None = None if params.greedy else []
        for i in range(k):
            tok, q, confidence = choose_token(logits, params, rng)
            if probs is not None:
                probs.append(q)
            tokens.append(tok)
            if i > 0 and confidence < self.min_confidence:
                break  # keep the unsure token (one try is cheap), stop paying for more
            if i + 1 < k:  # the last proposal need not be fed: its logits are never used
                logits = be.eval([tok], all_logits=False, copy=False)[-1]
        return Proposal(
            tokens=tokens,
            probs=probs,
            key=self.id,
            catchup_s=catchup_s,
            catchup_tokens=len(context) - kept,
        )

    def catchup_tokens(self, context: list[int]) -> int:
        return len(context) - common_prefix(self.backend.tokens, context[:-1])

    def memory_bytes(self) -> int:
        return self.backend.weight_bytes() + self.backend.kv_bytes_per_token() * self.backend.n_ctx

    def close(self) -> None:
        self.backend.close()


def choose_token(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[int, np.ndarray | None, float]:
    """A draft's next token from its logits: the argmax (greedy) or a draw from the user's
    distribution q, which is returned too (sampling); and the token's probability, by which
    a draft stops early."""
    if params.greedy:
        tok = int(np.argmax(logits))
        return tok, None, top_probability(logits, tok)
    q = probs_from_logits(logits, params)
    tok = sample(q, rng)
    return tok, q, float(q[tok])


def top_probability(logits: np.ndarray, token: int) -> float:
    """softmax(logits)[token] without materialising the whole distribution twice (float32:
    a stopping heuristic, it never changes the output)."""
    z = logits - logits[token]
    return float(1.0 / np.exp(z).sum(dtype=np.float64))
