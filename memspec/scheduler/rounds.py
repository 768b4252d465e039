"""The scheduler: the one per-round chooser of (draft, k), for the daemon and the simulator.

Each request's rounds are one of three round policies, built in `Scheduler.begin`:
- plain (draft "none"): engine.policy.FixedPolicy(None, 0);
- ResidentRule (`auto`, or the one draft a request named): the decision rule over the drafts
  resident now, re-read every round (a draft loaded mid-request is used from the next round,
  one evicted stops being offered; output unchanged). Slots beside the lead (LEAD_SLOT) run
  it over free drafts (`beside_lead`);
- PolicyRounds: a named Policy (`memspec`, `ucb`, `exp3`, `fixed:<id>`), one instance per
  name so what it learns carries over between requests. memspec (`rounds_by_rule`) plans
  residency and learns; its rounds are a ResidentRule's, primed with its round priors.
The simulator runs this Scheduler over its SimWorkingSet, trace-backed drafts and clock.

Leases: drafts handed to the engine are leased to its thread (WorkingSet), so an eviction
cannot close one while it proposes; released when the next round starts or the request ends.
A policy's round is timed from one engine choose() to the next, so its reward includes all it cost
(drafting, verification, waits on reactive loads). Time inside the policy, peeks excluded, is
the scheduling overhead, in this thread's CPU time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memspec.engine.costs import AcceptanceEstimator, CostModel, RoundCosts
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy
from memspec.engine.types import Choice, Draft, Proposal, RoundPolicy, SamplingParams
from memspec.errors import InvalidRequest, MemSpecError
from memspec.predictor.model import AcceptancePredictor
from memspec.scheduler.draft_choice import AUTO_ASK, DraftAsk
from memspec.scheduler.policies import (
    DraftInfo,
    Env,
    Policy,
    Request,
    Residency,
    Round,
    make_policy,
)

NAMED_POLICIES = ("memspec", "ucb", "exp3")  # besides auto and fixed:<id>
# The lead slot: the one sequence slot of a batched target whose rounds the Scheduler decides
# by the request's policy over every resident draft. Model drafts and heads keep one
# sequence's state (a KV cache, the target's feature at one position), so only one slot can
# use them; every other slot runs `Scheduler.beside_lead`, the rule over free drafts.
LEAD_SLOT = 0
# Without a measured load yet, assume this many bytes per second (a conservative disk read).
FALLBACK_LOAD_BANDWIDTH = 500e6


@dataclass
class RoundStats:
    rounds: int = 0
    policy_s: float = 0.0  # CPU s inside begin/select_draft/record_round/end, peeks excluded
    stall_s: float = 0.0  # waiting on reactive loads
    drafts_used: dict[str, int] = field(default_factory=dict)


@dataclass
class OpenRound:
    """A policy's round between its choice and the next: what its record_round() is told."""

    draft: str | None
    position: int
    t0: float
    key: str = ""
    proposed: int = 0
    accepted: int = 0


def chat_text(messages: list[dict[str, str]] | None, text: str = "") -> tuple[str, int]:
    """What the predictor reads: the last user message and the number of user turns (no
    messages: `text`, the prompt as sent, one turn)."""
    users = [m["content"] for m in messages or [] if m.get("role") == "user"]
    return (users[-1].strip(), len(users)) if users else (text, 1)


class ResidentRule:
    """The decision rule over the drafts resident now (`ids`: only those; `free_only`: only
    drafts that propose without a forward pass of their own), rebuilt when residency changes;
    `k`: a fixed k for the first of them instead of the rule's."""

    def __init__(
        self,
        sched: Scheduler,
        estimator: AcceptanceEstimator,
        ids: list[str] | None = None,
        free_only: bool = False,
        k: int | None = None,
    ):
        self.sched, self.estimator = sched, estimator
        self.ids, self.free_only, self.k = ids, free_only, k
        self._rule: RoundPolicy = FixedPolicy(None, 0)
        self._resident: tuple[str, ...] | None = None

    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        drafts = self.sched.ws.lease_resident(self.ids)
        if self.free_only:
            drafts = [d for d in drafts if d.free]
        resident = tuple(d.id for d in drafts)
        if resident != self._resident:  # rebuilt only when residency changes
            self._resident = resident
            k_max = self.sched.k_max
            if self.k is not None:
                self._rule = FixedPolicy(drafts[0] if drafts else None, min(self.k, k_max))
            else:
                self._rule = DecisionRulePolicy(drafts, self.sched.costs, self.estimator, k_max)
        return self._rule.choose(context, k_room, params, rng)

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        self._rule.observe(key, proposed, accepted, seconds)

    def observe_costs(self, measured: RoundCosts) -> None:
        self.sched.costs.observe(measured)


class PolicyRounds:
    """A named Policy's rounds of one request: its choice (or, `rounds_by_rule`, a
    ResidentRule's), the peeks it asks for, reactive loads, and its record_round() per round."""

    def __init__(
        self, sched: Scheduler, policy: Policy, request: Request, rule: ResidentRule | None
    ):
        self.sched, self.policy, self.request, self.rule = sched, policy, request, rule
        self.open: OpenRound | None = None

    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        now = self.sched.clock()
        self.close(now)
        position = len(context) - len(self.request.prompt)
        if self.rule is not None:
            t = time.thread_time()
            choice = self.rule.choose(context, k_room, params, rng)
            self.sched.stats.policy_s += time.thread_time() - t
        else:
            choice = self._by_policy(position, context, k_room, params, rng)
        used = choice.draft.id if choice.draft is not None and choice.k > 0 else None
        self.open = OpenRound(used, position, now, key=used or "")
        if used is not None:
            self.sched.stats.drafts_used[used] = self.sched.stats.drafts_used.get(used, 0) + 1
        return choice

    def _by_policy(
        self,
        position: int,
        context: list[int],
        k_room: int,
        params: SamplingParams,
        rng: np.random.Generator,
    ) -> Choice:
        peeks: dict[str, tuple[str, int, Proposal | None, Draft | None]] = {}
        peek_s = 0.0

        def peek(draft_id: str) -> tuple[str, int]:
            nonlocal peek_s
            if draft_id not in peeks:
                t = time.thread_time()
                draft = self.sched.ws.get(draft_id)
                if draft is None:
                    peeks[draft_id] = (draft_id, 0, None, None)
                else:
                    p = draft.propose(context, min(self.sched.k_max, k_room), params, rng)
                    peeks[draft_id] = (p.key or draft_id, len(p.tokens), p, draft)
                peek_s += time.thread_time() - t
            return peeks[draft_id][:2]

        t = time.thread_time()
        draft_id, k = self.policy.select_draft(Round(position, k_room, peek), self.sched.ws)
        self.sched.stats.policy_s += time.thread_time() - t - peek_s
        if draft_id is None or k <= 0:
            return Choice(None, 0)
        if draft_id in peeks:
            _, n, proposal, draft = peeks[draft_id]
            if proposal is None or n <= 0:
                return Choice(None, 0)
            proposal.tokens = proposal.tokens[:k]
            if proposal.probs is not None:
                proposal.probs = proposal.probs[:k]
            return Choice(draft, min(k, n), proposal)
        draft = self.sched.ws.get(draft_id)
        if draft is None and self.policy.reactive:
            t = self.sched.clock()
            try:
                draft = self.sched.ws.acquire(draft_id, wait=True)
            except MemSpecError:  # cannot fit beside pinned drafts: no draft this round
                draft = None
            self.sched.stats.stall_s += self.sched.clock() - t
        return Choice(draft, k) if draft is not None else Choice(None, 0)

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        if self.rule is not None:
            self.rule.observe(key, proposed, accepted, seconds)
        if self.open is not None:
            self.open.key, self.open.proposed, self.open.accepted = key, proposed, accepted

    def close(self, now: float) -> None:
        """The round in flight is over at `now`: the policy records it (record_round)."""
        o, self.open = self.open, None
        if o is None:
            return
        self.sched.stats.rounds += 1
        t = time.thread_time()
        self.policy.record_round(
            o.draft if o.proposed > 0 else None,
            o.key,
            o.position,
            o.proposed,
            o.accepted,
            now - o.t0,
            o.accepted + 1,
        )
        self.sched.stats.policy_s += time.thread_time() - t


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
        # The request in progress: its round policy, and its named policy's rounds (if any).
        self.rounds: FixedPolicy | ResidentRule | PolicyRounds = FixedPolicy(None, 0)
        self._by_policy: PolicyRounds | None = None
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
        self.stats, self._by_policy = RoundStats(), None
        if draft.plain:
            self.rounds = FixedPolicy(None, 0)
            return "none"
        if draft.named is not None or policy == "auto":
            est = estimator or self.estimator
            self.rounds = ResidentRule(self, est, draft.ids, k=k)
            if draft.named is not None:
                self._held.enter_context(self.ws.holding(draft.named))  # not a victim while used
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
        their own)."""
        self.stats = RoundStats()
        t = time.thread_time()
        policy.begin(request, self.ws)
        self.stats.policy_s += time.thread_time() - t
        rule = None
        if policy.rounds_by_rule:
            est = estimator or self.rule_estimators.setdefault(policy.name, AcceptanceEstimator())
            for key, alpha in policy.round_priors().items():
                est.set_prior(key, alpha)
            rule = ResidentRule(self, est)
        self._by_policy = PolicyRounds(self, policy, request, rule)
        self.rounds = self._by_policy

    def beside_lead(self, draft: DraftAsk) -> RoundPolicy:
        """The round policy of a slot decoded beside the lead (LEAD_SLOT): the decision rule
        over the resident free drafts (prompt lookup, datastores), whatever policy the request
        named: under load the batch-level rule would seldom pay for a model draft's serial
        passes anyway (docs/batching.md). A named draft is used here only if it is free."""
        if draft.plain:
            return FixedPolicy(None, 0)
        return ResidentRule(self, self.estimator, draft.ids, free_only=True)

    def finish(self) -> RoundStats:
        """Close the last round and end the request (once, after generation)."""
        rounds = self._by_policy
        if rounds is not None:
            rounds.close(self.clock())
            t = time.thread_time()
            rounds.policy.end()
            self.stats.policy_s += time.thread_time() - t
        self.abort()
        return self.stats

    def abort(self) -> None:
        """Let go of the request's drafts (leases, holds) without ending it."""
        self.ws.release_leases()
        self._held.close()
        self._by_policy = None

    # --- the engine's RoundPolicy -------------------------------------------------------
    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        self.ws.release_leases()  # the previous round's proposal is verified by now
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
