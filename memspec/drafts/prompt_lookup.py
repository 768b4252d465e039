"""Prompt lookup: copy the continuation of the latest earlier occurrence of the context's tail.

Zero weights, zero memory beyond the context. Wins on extraction/rewriting where the answer
quotes the prompt; proposes nothing when the tail has not been seen before.
"""

from __future__ import annotations

import numpy as np

from memspec.engine.sampling import SamplingParams
from memspec.engine.types import Draft, Proposal


class PromptLookupDraft(Draft):
    kind = "prompt_lookup"
    free = True  # proposing is a lookup in the context: the rule may peek it

    def __init__(self, id: str = "prompt-lookup", max_ngram: int = 3, min_ngram: int = 1):
        self.id = id
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def find(self, context: list[int], k: int) -> tuple[list[int], int]:
        """Continuation (≤ k tokens) after the latest earlier match of the longest tail n-gram."""
        n_ctx = len(context)
        if k <= 0 or n_ctx < self.min_ngram + 1:
            return [], 0
        arr = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = arr[n_ctx - n :]
            # Windows starting at 0..n_ctx-n-1 (exclude the tail itself).
            windows = np.lib.stride_tricks.sliding_window_view(arr[: n_ctx - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # most recent occurrence: likeliest to continue
                return context[start : start + k], n
        return [], 0

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        tokens, n = self.find(context, k)
        return Proposal(tokens=tokens, probs=None, key=f"{self.id}/n{n}")
