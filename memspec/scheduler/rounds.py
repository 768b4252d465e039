"""The scheduler: which policy decides a request's rounds, for the daemon and the simulator.

Each request's rounds are one of two kinds, chosen in `Scheduler.begin`:
- plain (draft "none"): engine.policy.FixedPolicy(None, 0);
- a policy (scheduler.policies), itself the engine's RoundPolicy: `auto` (or the one draft a
  request named) is a RulePolicy, the decision rule over the drafts resident now, made per
  request; a named policy (`memspec`, `ucb`, `exp3`, `fixed:<id>`) has one instance per name so
  what it learns carries over between requests. Slots beside the lead (LEAD_SLOT) run a
  RulePolicy over free drafts (`beside_lead`).
The simulator runs this Scheduler over its SimWorkingSet, trace-backed drafts and clock.

Leases: drafts a policy hands the engine are leased to its thread (WorkingSet), so an eviction
cannot close one while it proposes; the round that used them releases them when it ends
(Runtime.decode_round: `WorkingSet.leased`), however it ends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np

from memspec.engine.costs import AcceptanceEstimator, CostModel, RoundCosts
from memspec.engine.policy import FixedPolicy
from memspec.engine.types import Choice, RoundPolicy, SamplingParams
from memspec.errors import InvalidRequest
from memspec.predictor.model import AcceptancePredictor
from memspec.scheduler.draft_choice import AUTO_ASK, DraftAsk
from memspec.scheduler.policies import (
    DraftInfo,
    Env,
    Policy,
    Request,
    Residency,
    RoundStats,
    RulePolicy,
    make_policy,
)

__all__ = ["LEAD_SLOT", "NAMED_POLICIES", "RoundStats", "Scheduler", "chat_text"]

NAMED_POLICIES = ("memspec", "ucb", "exp3")  # besides auto and fixed:<id>
# The lead slot: the one sequence slot of a batched target whose rounds the Scheduler decides
# by the request's policy over every resident draft. Model drafts and heads keep one
# sequence's state (a KV cache, the target's feature at one position), so only one slot can
# use them; every other slot runs `Scheduler.beside_lead`, the rule over free drafts.
LEAD_SLOT = 0
# Without a measured load yet, assume this many bytes per second (a conservative disk read).
FALLBACK_LOAD_BANDWIDTH = 500e6


def chat_text(messages: list[dict[str, str]] | None, text: str = "") -> tuple[str, int]:
    """What the predictor reads: the last user message and the number of user turns (no
    messages: `text`, the prompt as sent, one turn)."""
    users = [m["content"] for m in messages or [] if m.get("role") == "user"]
    return (users[-1].strip(), len(users)) if users else (text, 1)


class Scheduler:
    """Decides each round of the Runtime's lead slot over its working set (one request at a
    time); `clock`: the seconds a policy's round is timed by (the simulator's is virtual)."""

    def __init__(
        self,
        working_set: Residency,
        costs: CostModel,
        estimator: AcceptanceEstimator,
        k_max: int,
        predictor: AcceptancePredictor | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.ws, self.costs, self.k_max, self.clock = working_set, costs, k_max, clock
        self.estimator = estimator  # the runtime's: acceptance learnt across requests
        self.predictor = predictor or AcceptancePredictor.fallback("no predictor given")
        self.env = Env({}, costs, k_max)
        self.policies: dict[str, Policy] = {}  # named policies, made on first use
        # Acceptance learnt by the rule's rounds of a named policy, kept across its requests.
        self.rule_estimators: dict[str, AcceptanceEstimator] = {}
        self.stats = RoundStats()
        # The request in progress: its round policy (a Policy, or plain decoding).
        self.rounds: RoundPolicy = FixedPolicy(None, 0)
        self._held = contextlib.ExitStack()

    @property
    def names(self) -> tuple[str, ...]:
        """The policy names a request may use."""
        ids = self.ws.source.draft_ids()  # type: ignore[attr-defined] - the live set's
        return ("auto", *NAMED_POLICIES, *(f"fixed:{d}" for d in ids))

    def check_policy(self, name: str) -> None:
        """A policy name a request (or settings.policy) may use: the one check, one message."""
        if name not in self.names:
            raise InvalidRequest(
                f"unknown policy {name!r}; known: {', '.join(sorted(self.names))}",
                param="policy",
            )

    # --- a request ----------------------------------------------------------------------
    def begin(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        draft: DraftAsk = AUTO_ASK,
        k: int | None = None,
        policy: str = "auto",
        messages: list[dict[str, str]] | None = None,
        estimator: AcceptanceEstimator | None = None,
    ) -> str:
        """Start a request: `draft` plain, a named draft (used while resident; loaded now if it
        is not), or auto: then `policy` decides ("auto": the decision rule).
        Returns the policy its rounds run under: "none", "auto" or the named policy."""
        self.stats = RoundStats()
        if draft.plain:
            self.rounds = FixedPolicy(None, 0)
            return "none"
        if draft.named is not None or policy == "auto":
            rule = RulePolicy(self.env, estimator or self.estimator, draft.ids, k=k)
            self.begin_policy(rule, Request("", prompt, max_tokens=params.max_tokens))
            if draft.named is not None:
                self._held.enter_context(self.ws.holding(draft.named))  # not a victim while used
                with self.ws.leased():  # loaded now; the rounds lease it as they use it
                    self.ws.acquire(draft.named, wait=True)
            return "auto"
        text, turns = chat_text(messages)
        request = Request("", prompt, text, turns, params.max_tokens)
        self.begin_policy(self.policy(policy), request, estimator)
        return policy

    def begin_policy(
        self, policy: Policy, request: Request, estimator: AcceptanceEstimator | None = None
    ) -> None:
        """Start a request that `policy` decides (the live bench and the simulator bring
        their own). A policy deciding by the rule learns in its name's estimator (kept across
        its requests, saved with what was learnt) unless given one."""
        if isinstance(policy, RulePolicy) and policy.name != "auto":
            est = estimator or self.rule_estimators.setdefault(policy.name, AcceptanceEstimator())
            policy.estimator = est
        elif isinstance(policy, RulePolicy) and estimator is not None:
            policy.estimator = estimator
        self.stats = RoundStats()
        policy.begin(request, self.ws, self.stats, self.clock)
        self.rounds = policy

    def beside_lead(self, draft: DraftAsk) -> RoundPolicy:
        """The round policy of a slot decoded beside the lead (LEAD_SLOT): the decision rule
        over the resident free drafts (prompt lookup, datastores), whatever policy the request
        named: under load the batch-level rule would seldom pay for a model draft's serial
        passes anyway (docs/batching.md). A named draft is used here only if it is free."""
        if draft.plain:
            return FixedPolicy(None, 0)
        rule = RulePolicy(self.env, self.estimator, draft.ids, free_only=True)
        rule.begin(Request("", []), self.ws, clock=self.clock)
        return rule

    def finish(self) -> RoundStats:
        """Close the last round and end the request (once, after generation)."""
        if isinstance(self.rounds, Policy):
            self.rounds.finish()
        self.abort()
        return self.stats

    def abort(self) -> None:
        """Let go of the request's held drafts without ending it (its leases end with its
        round: Runtime.decode_round)."""
        self._held.close()
        self.rounds = FixedPolicy(None, 0)

    # --- the lead slot's RoundPolicy: the request's ----------------------------------------
    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        return self.rounds.choose(context, k_room, params, rng)

    def observe_costs(self, measured: RoundCosts) -> None:
        self.costs.observe(measured)

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        self.rounds.observe(key, proposed, accepted, seconds)

    # --- named policies -----------------------------------------------------------------
    def policy(self, name: str) -> Policy:
        """The named policy's one instance, told the drafts' sizes and load times as the
        working set knows them now."""
        self.check_policy(name)
        if name == "auto":  # the bare rule (begin), never an instance: a caller's bug
            raise ValueError("policy 'auto' is the decision rule, not a named policy")
        for row in self.ws.status():  # type: ignore[attr-defined] - the live set's
            size = int(row["bytes"] or 0)
            load_s = row["load_s"] if row["load_s"] is not None else size / FALLBACK_LOAD_BANDWIDTH
            self.env.drafts[row["id"]] = DraftInfo(
                row["id"], row["kind"], size, float(load_s), bool(row.get("shares_target_kv"))
            )
        if name not in self.policies:
            self.policies[name] = make_policy(name, self.env, self.predictor)
        return self.policies[name]

    def status(self) -> dict:
        """Policy state and predictor status for the daemon's status/admin output."""
        return {
            "predictor": self.predictor.describe(),
            "policies": {n: p.status() for n, p in self.policies.items()},
        }
