"""Round policies: each round, pick (draft, k) — or no draft — by the decision rule."""

from __future__ import annotations

from memspec.backends.base import common_prefix
from memspec.engine.costs import AcceptanceEstimator, CostModel, RoundCosts, match_prior
from memspec.engine.types import Choice, Draft, RoundPolicy

__all__ = ["Choice", "DecisionRulePolicy", "FixedPolicy", "RoundPolicy"]


class FixedPolicy:
    """One draft, fixed k (k = 0 or no draft: plain decoding)."""

    def __init__(self, draft: Draft | None, k: int):
        self.draft, self.k = draft, k

    def choose(self, context, k_room, params, rng) -> Choice:
        return Choice(self.draft, min(self.k, k_room) if self.draft else 0)

    def observe(self, key, proposed, accepted, seconds) -> None:
        pass

    def observe_costs(self, measured: RoundCosts) -> None:
        pass


class DecisionRulePolicy:
    """Among the given drafts (and none), the (draft, k) with the highest expected tokens/s.

    Free drafts (prompt lookup: no forward pass of their own) are peeked first: their
    acceptance depends on whether and how long a match exists, so α is estimated per match
    length (the proposal's key; a length not seen yet starts at match_prior) and k is capped
    by the match: a long copy is drafted deep (memspec.drafts.prompt_lookup).
    """

    def __init__(
        self,
        drafts: list[Draft],
        costs: CostModel,
        estimator: AcceptanceEstimator,
        k_max: int = 8,
    ):
        self.drafts, self.costs, self.estimator, self.k_max = drafts, costs, estimator, k_max
        # Free (lookup) proposals, whole, chosen or not: (context length, key, tokens). Each
        # is scored against what the target then produced, so the estimate sees every run to
        # its end (a chosen proposal is verified only up to k), and a lookup whose estimate
        # fell can earn its way back without ever being paid for.
        self._shadow: list[tuple[int, str, list[int]]] = []
        self._free_keys: set[str] = set()

    def _score_shadows(self, context: list[int]) -> None:
        for start, key, tokens in self._shadow:
            actual = context[start : start + len(tokens)]
            if len(actual) < len(tokens):
                continue  # not enough output yet to judge the whole proposal; drop it
            self.estimator.update(key, len(tokens), common_prefix(tokens, actual))
        self._shadow = [s for s in self._shadow if len(context) < s[0] + len(s[2])]

    def choose(self, context, k_room, params, rng) -> Choice:
        self._score_shadows(context)
        k_cap, n = min(self.k_max, k_room), len(context)
        best, best_rate = Choice(None, 0), self.costs.rate(None, 0.0, 0, context=n)
        if k_cap <= 0:
            return best
        for draft in self.drafts:
            proposal, limit = None, k_cap
            if draft.free:
                proposal = draft.propose(context, k_cap, params, rng)
                if not proposal.tokens:
                    continue
                key, limit = proposal.key, len(proposal.tokens)
                if proposal.match:
                    self.estimator.seed_prior(key, match_prior(proposal.match))
                self._shadow.append((len(context), key, list(proposal.tokens)))
                self._free_keys.add(key)
            else:
                key = draft.id
            alpha, cont = self.estimator.alpha(key), self.estimator.alpha_cont(key)
            k, rate = self.costs.best_k(draft.id, alpha, limit, cont, context=n)
            if k > 0 and not draft.free:  # a model draft behind the context pays to catch up
                rate = self.costs.with_catchup(
                    rate, draft.id, draft.catchup_tokens(context), k_room
                )
            if k > 0 and rate > best_rate:
                if proposal is not None:
                    proposal.tokens = proposal.tokens[:k]
                best, best_rate = Choice(draft, k, proposal, alpha, cont), rate
        return best

    def observe_costs(self, measured: RoundCosts) -> None:
        self.costs.observe(measured)

    def observe(self, key, proposed, accepted, seconds) -> None:
        if key not in self._free_keys:  # free proposals are scored whole, as shadows
            self.estimator.update(key, proposed, accepted)
