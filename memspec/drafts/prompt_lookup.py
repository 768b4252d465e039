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
        # n-gram -> start of its latest occurrence, per n, over the context indexed so far.
        # The engine asks every round with the same context grown by a few tokens, so only the
        # new windows are added (a rescan of the whole context each round cost ~1 ms).
        self._seen: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}

    def _index(self, context: list[int]) -> None:
        """Index every window that ends before the context's last token (the tail itself is
        what is looked up, so it must not match itself)."""
        done = len(self._seen)
        if done > len(context) or context[:done] != self._seen:  # another request: start over
            self._seen, self._latest, done = [], {}, 0
        end = len(context) - 1  # windows lie in context[:end]
        for n in range(self.min_ngram, self.max_ngram + 1):
            table = self._latest.setdefault(n, {})
            for i in range(max(done - n, 0), end - n + 1):
                table[tuple(context[i : i + n])] = i
        self._seen = context[:end]

    def find(self, context: list[int], k: int) -> tuple[list[int], int]:
        """Continuation (≤ k tokens) after the latest earlier match of the longest tail n-gram."""
        n_ctx = len(context)
        if k <= 0 or n_ctx < self.min_ngram + 1:
            return [], 0
        self._index(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            hit = self._latest[n].get(tuple(context[n_ctx - n :]))
            if hit is not None:
                start = hit + n  # most recent occurrence: likeliest to continue
                return context[start : start + k], n
        return [], 0

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        tokens, n = self.find(context, k)
        return Proposal(tokens=tokens, probs=None, key=f"{self.id}/n{n}")
