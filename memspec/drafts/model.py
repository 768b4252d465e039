"""A draft that is a (smaller or quantized) language model behind the Backend interface."""

from __future__ import annotations

import time

import numpy as np

from memspec.backends.base import Backend, common_prefix
from memspec.engine.sampling import SamplingParams, probs_from_logits, sample
from memspec.engine.types import Draft, Proposal

# A draft this far behind a KV donor copies the donor's cache rather than feed the tokens.
DONOR_MIN_TOKENS = 8


class ModelDraft(Draft):
    kind = "model"

    def __init__(
        self,
        id: str,
        backend: Backend,
        min_confidence: float = 0.3,
        kv_donor: Backend | None = None,
    ):
        self.id = id
        self.backend = backend
        # Stop drafting once the draft's own top probability falls below this: an unsure
        # token is likely rejected and would waste the remaining draft steps. Only the
        # proposal's length changes, so this cannot affect the output.
        self.min_confidence = min_confidence
        # A backend of the same KV layout (the target, for a self-draft) whose cache the draft
        # copies instead of feeding a long context itself: the prompt's catch-up becomes a
        # memory copy (measured on SmolLM2 q8_0: 171-1043 ms -> 2-12 ms, acceptance unchanged).
        # The draft's cache then holds the target's keys and values, not its own: that changes
        # proposals only, never what the target accepts.
        self.kv_donor = kv_donor if shares_kv(kv_donor, backend) else None
        self.donor_refused: str | None = None  # why a copy failed (the donor is then dropped)

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        if k <= 0:
            return Proposal(key=self.id)
        be = self.backend
        # Catch up: keep the shared prefix (rejected candidates are truncated away), then feed
        # what is new since last round — usually just the target's correction token.
        t = time.perf_counter()
        kept = self.cached_prefix(context)
        donor_s = time.perf_counter() - t
        room = be.n_ctx - len(context)
        k = min(k, room)
        if k <= 0:
            return Proposal(key=self.id)
        t = time.perf_counter()
        # Views of the draft's logits buffer (no copy): each is read before the next eval.
        logits = be.eval(context[kept:], all_logits=False, copy=False)[-1]
        catchup_s = time.perf_counter() - t + donor_s
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

    def cached_prefix(self, context: list[int]) -> int:
        """Keep what the draft's cache shares with `context` (or copy the donor's, when that
        saves feeding enough tokens); the context tokens the cache now holds."""
        kept = self.backend.reuse_prefix(context[:-1])
        if (shared := self._donor_prefix(context, kept)) > kept:
            kept = self._copy_donor(context, shared)
        return kept

    def catchup_tokens(self, context: list[int]) -> int:
        kept = common_prefix(self.backend.tokens, context[:-1])
        return len(context) - max(kept, self._donor_prefix(context, kept))

    def _donor_prefix(self, context: list[int], kept: int) -> int:
        """The context the donor's cache holds, when copying it beats feeding the tokens past
        `kept` (what the draft's own cache holds); else 0."""
        if self.kv_donor is None or len(context) - 1 - kept < DONOR_MIN_TOKENS:
            return 0  # the common case each round: only the correction token to feed
        shared = common_prefix(self.kv_donor.tokens, context[:-1])
        return shared if shared - kept >= DONOR_MIN_TOKENS else 0

    def _copy_donor(self, context: list[int], shared: int) -> int:
        """Load the donor's cache and keep the `shared` context tokens of it; the context
        tokens the draft's cache now holds."""
        donor, be = self.kv_donor, self.backend
        assert donor is not None
        snapshot = donor.kv_snapshot()
        if snapshot is None or not be.kv_restore(snapshot):
            # Not an error: the draft catches up by itself, as one without a donor does.
            self.kv_donor = None
            self.donor_refused = f"{type(donor).__name__} snapshot not loadable into {be.path.name}"
        # The donor may hold more than this context shares (and a window-sized cache may not
        # hold what the shared prefix's end attends to): keep what is reusable of it.
        return be.reuse_prefix(context[:-1])

    def memory_bytes(self) -> int:
        return self.backend.weight_bytes() + self.backend.kv_bytes_per_token() * self.backend.n_ctx

    def close(self) -> None:
        self.backend.close()


def shares_kv(donor: Backend | None, backend: Backend) -> bool:
    """Whether `backend` can load `donor`'s KV snapshots (same layout, room for its context)."""
    if donor is None or donor is backend:
        return False
    layout = backend.kv_layout()
    return layout is not None and layout == donor.kv_layout() and backend.n_ctx >= donor.n_ctx


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
