"""Prompt lookup: copy what followed the longest earlier match of the context's tail.

Zero weights, zero memory beyond the context. Wins on extraction/rewriting where the answer
quotes the prompt, and most of all on edits of a file ("rename x, return the whole file"),
where the answer is the prompt copied; proposes nothing when the tail has not been seen before.

How deep to draft (the one rule): a proposal reports its *match length* m, the number of
context tokens before the copy point that equal the tail (a 3-gram hit inside a copied file
can run back 200 tokens), bucketed (`match_bucket`: m itself up to 8, then powers of two up
to RUN_CAP), as Proposal.match and in its acceptance statistic's key ("prompt-lookup/n64").
Each round the decision rule picks

    k = argmax over 0..min(k_max, proposal) of expected_tokens(α₁, α_c, k) / round_seconds(k)

with α₁/α_c the running acceptance of that key (starting, before its first round, at
costs.match_prior(m) = m / (m + 2), then following what its proposals had accepted; every
proposal, drafted or not, is scored whole against the output: engine.policy's shadows) and
round_seconds from the calibrated verify curve. So a copy that has run long, whose
continuations keep being accepted, is drafted deep from its first round; a short or
coincidental match, accepted less, shallow or not at all; and no k is chosen where its
verification would lower tokens per second (on a CPU a few tokens, on a GPU up to k_max).

The copy point: the longest tail n-gram (max_ngram at most) that occurred before; among the
latest CANDIDATES occurrences of a max_ngram-gram, the one whose match runs back furthest
(ties: the latest). A match that the tokens added since the last round continued is followed
without a lookup (an accepted copy stays on its source, where the latest occurrence of a common
3-gram, e.g. an indented `self.`, would jump elsewhere in the file).
"""

from __future__ import annotations

import numpy as np

from memspec.engine.sampling import SamplingParams
from memspec.engine.types import Draft, Proposal

# The indexed context's last tokens kept to tell the same list grown at its end (the engine
# appends to one list per request) from one edited where the index ends.
MARK_TOKENS = 8
# Matches at least this long share one acceptance statistic, and no lookup measures a match
# further back: a copy that has run this far is as likely to go on as it will get.
RUN_CAP = 256
# Occurrences of the tail n-gram whose match length a lookup measures (the latest ones): in an
# 8k-token source file a common 3-gram occurs hundreds of times.
CANDIDATES = 64


def match_bucket(m: int) -> int:
    """The match length a match of m tokens counts its acceptance under: m up to 8, then the
    power of two at or below it, at most RUN_CAP."""
    if m <= 8:
        return m
    return 1 << (min(m, RUN_CAP).bit_length() - 1)


def key_match(key: str) -> int:
    """The match length a lookup's statistic key stands for: "draft/n64" (prompt lookup) and
    "draft/c64" (a datastore's context match) are copies of 64 tokens; other keys are not
    copies (0). Proposal.match is this, so a replay of the keys alone (the simulator) gives
    the rule what the live drafts gave it."""
    draft, _, tail = key.rpartition("/")
    return int(tail[1:]) if draft and tail[:1] in ("n", "c") and tail[1:].isdigit() else 0


def run_length(context: list[int], a: int, b: int, cap: int) -> int:
    """How many tokens, going back from positions a < b together, are equal (at most cap)."""
    n = 0
    while n < cap and a - n >= 0 and context[a - n] == context[b - n]:
        n += 1
    return n


class PromptLookupDraft(Draft):
    kind = "prompt_lookup"
    free = True  # proposing is a lookup in the context: the rule may peek it

    def __init__(self, id: str = "prompt-lookup", max_ngram: int = 3, min_ngram: int = 1):
        self.id = id
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # n-gram -> start of its latest occurrence, per n < max_ngram; max_ngram-grams -> all
        # their starts, in order (the copy point is chosen among them by match length). The
        # engine asks every round with the same context grown by a few tokens, so only the new
        # windows are added (a rescan of the whole context each round cost ~1 ms).
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}
        self._all: dict[tuple[int, ...], list[int]] = {}
        self._ctx: list[int] = []  # the context indexed last (the engine's list, not a copy)
        self._done = 0  # how many of its tokens the index covers
        self._mark: list[int] = []  # its last MARK_TOKENS covered tokens, as they were
        # The last match: the continuation's start in the context, its length, and the
        # context's length then (0 length: none to follow).
        self._src, self._run, self._at = 0, 0, 0

    def _index(self, context: list[int]) -> None:
        """Index every window that ends before the context's last token (the tail itself is
        what is looked up, so it must not match itself)."""
        done = self._done
        if not self._extends(context, done):  # another request: start over
            self._latest, self._all, done = {}, {}, 0
            self._run = 0
        end = len(context) - 1  # windows lie in context[:end]
        top = self.max_ngram
        for n in range(self.min_ngram, top):
            table = self._latest.setdefault(n, {})
            for i in range(max(done - n, 0), end - n + 1):
                table[tuple(context[i : i + n])] = i
        starts = self._all
        for i in range(max(done - top, 0), end - top + 1):
            starts.setdefault(tuple(context[i : i + top]), []).append(i)
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

    def _follow(self, context: list[int]) -> tuple[int, int]:
        """The last match, if the tokens added since continue it: (its new start, length)."""
        src, at = self._src, self._at
        j = len(context) - at
        if self._run <= 0 or j < 0 or context[src - 1] != context[at - 1]:
            return 0, 0
        if context[src : src + j] != context[at:]:
            return 0, 0
        return src + j, self._run + j

    def _lookup(self, context: list[int]) -> tuple[int, int]:
        """The copy point of the longest tail n-gram seen before: (continuation start, match
        length); (0, 0) when there is none."""
        n_ctx = len(context)
        top = self.max_ngram
        if n_ctx - 1 >= top:
            starts = self._all.get(tuple(context[n_ctx - top :]))
            if starts:
                best, best_run = starts[-1], 0
                for i in reversed(starts[-CANDIDATES:]):
                    run = top + run_length(context, i - 1, n_ctx - top - 1, RUN_CAP - top)
                    if run > best_run:
                        best, best_run = i, run
                return best + top, best_run
        for n in range(min(top - 1, n_ctx - 1), self.min_ngram - 1, -1):
            hit = self._latest[n].get(tuple(context[n_ctx - n :]))
            if hit is not None:
                # No longer n-gram occurred, so every occurrence matches n tokens exactly:
                # the most recent is the likeliest to continue.
                return hit + n, n
        return 0, 0

    def find(self, context: list[int], k: int) -> tuple[list[int], int]:
        """Continuation (≤ k tokens) from the copy point, and the match length there."""
        n_ctx = len(context)
        if k <= 0 or n_ctx < self.min_ngram + 1:
            return [], 0
        self._index(context)
        src, run = self._follow(context)
        if run == 0:
            src, run = self._lookup(context)
        self._src, self._run, self._at = src, run, n_ctx
        return (context[src : src + k], run) if run else ([], 0)

    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        tokens, m = self.find(context, k)
        b = match_bucket(m)
        return Proposal(tokens=tokens, probs=None, key=f"{self.id}/n{b}", match=b)
