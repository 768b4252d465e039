"""Prompt lookup: copy the continuation of the latest earlier occurrence of the context's tail.

Zero weights, zero memory beyond the context. Wins on extraction/rewriting where the answer
quotes the prompt; proposes nothing when the tail has not been seen before.
"""

from __future__ import annotations

import numpy as np

from memspec.engine.sampling import SamplingParams
from memspec.engine.types import Draft, Proposal

# The indexed context's last tokens kept to tell the same list grown at its end (the engine
# appends to one list per request) from one edited where the index ends.
MARK_TOKENS = 8


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
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}
        self._ctx: list[int] = []  # the context indexed last (the engine's list, not a copy)
        self._done = 0  # how many of its tokens the index covers
        self._mark: list[int] = []  # its last MARK_TOKENS covered tokens, as they were then

    def _index(self, context: list[int]) -> None:
        """Index every window that ends before the context's last token (the tail itself is
        what is looked up, so it must not match itself)."""
        done = self._done
        if not self._extends(context, done):  # another request: start over
            self._latest, done = {}, 0
        end = len(context) - 1  # windows lie in context[:end]
        for n in range(self.min_ngram, self.max_ngram + 1):
            table = self._latest.setdefault(n, {})
            for i in range(max(done - n, 0), end - n + 1):
                table[tuple(context[i : i + n])] = i
        self._ctx, self._done = context, max(end, 0)
        self._mark = context[max(end - MARK_TOKENS, 0) : max(end, 0)]

    def _extends(self, context: list[int], done: int) -> bool:
        """Whether `context` starts with the `done` tokens indexed. The list indexed last,
        grown in place (the engine's, every round), is checked where the index ends: O(1),
        where comparing (and copying) the whole prefix cost a pass over the context a round.
        Another list (a new request) is compared whole, once."""
        if done > len(context):
            return False
        if context is self._ctx:
            return context[done - len(self._mark) : done] == self._mark
        return context[:done] == self._ctx[:done]

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
