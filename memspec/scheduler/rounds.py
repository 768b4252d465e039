"""The scheduler: one object, owned by the Runtime, that is the engine's RoundPolicy.

Per request (begin ... finish) it decides every round by one of:
- a scheduling Policy (`memspec`, `ucb`, `exp3`, `fixed:<id>`; memspec.scheduler.policies),
  one instance per name, so bandit statistics, the predictor's online learning and memspec's
  view of the workload carry over from request to request;
- the decision rule over the drafts resident now (`auto`, or the one draft a request named):
  re-read every round, so a draft that finishes loading mid-request is used from the next
  round on, and one that is evicted simply stops being offered (output unchanged);
- plain decoding (`none`).

Leases: every draft handed to the engine is leased to the engine's thread (WorkingSet), so an
eviction cannot close it while it proposes. The scheduler drops the previous round's leases
when the next round starts and the last ones when the request finishes.

A policy's round is timed from one choose() to the next, so its reward includes everything
the round cost (drafting, verification, any wait on a reactive load). Cheap proposers are only
asked (peeked) when the policy looks at them. Time inside the policy, minus the peeks, is the
scheduling overhead, in this thread's CPU time (preemptions are not the policy's).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy
from memspec.engine.types import Choice, Draft, Proposal, RoundPolicy, SamplingParams
from memspec.errors import InvalidRequest, MemSpecError
from memspec.predictor.model import AcceptancePredictor
from memspec.scheduler.policies import DraftInfo, Env, Policy, Request, Round, make_policy
from memspec.scheduler.working_set import WorkingSet

NAMED_POLICIES = ("memspec", "ucb", "exp3")  # besides auto and fixed:<id>
# Without a measured load yet, assume this many bytes per second (a conservative disk read).
FALLBACK_LOAD_BANDWIDTH = 500e6


@dataclass
class RoundStats:
    rounds: int = 0
    policy_s: float = 0.0  # CPU s inside begin/choose/observe/end, peeks excluded
    stall_s: float = 0.0  # waiting on reactive loads
    drafts_used: dict[str, int] = field(default_factory=dict)


def chat_text(messages: list[dict[str, str]] | None, text: str = "") -> tuple[str, int]:
    """What the predictor reads: the last user message and the number of user turns (no
    messages: `text`, the prompt as sent, one turn)."""
    users = [m["content"] for m in messages or [] if m.get("role") == "user"]
    return (users[-1].strip(), len(users)) if users else (text, 1)


class Scheduler:
    """Decides each round of the Runtime's requests over its working set (one at a time)."""

    def __init__(
        self,
        working_set: WorkingSet,
        costs: CostModel,
        estimator: AcceptanceEstimator,
        k_max: int,
        predictor: AcceptancePredictor | None = None,
    ):
        self.ws = working_set
        self.costs = costs
        self.estimator = estimator  # the runtime's: acceptance learned across requests
        self.k_max = k_max
        self.predictor = predictor or AcceptancePredictor.fallback("no predictor given")
        self.env = Env({}, costs, k_max)
        self.policies: dict[str, Policy] = {}  # named policies, made on first use
        # Acceptance learnt by the rule's rounds of a named policy, kept across its requests.
        self.rule_estimators: dict[str, AcceptanceEstimator] = {}
        self.names = (
            "auto",
            *NAMED_POLICIES,
            *(f"fixed:{d}" for d in working_set.source.draft_ids()),
        )
        # The request in progress: a named policy, or the decision rule over resident drafts.
        self.stats = RoundStats()
        self._policy: Policy | None = None
        self._request: Request | None = None
        self._open: dict | None = None
        self._rule: RoundPolicy = FixedPolicy(None, 0)
        self._build: Callable[[list[Draft]], RoundPolicy] | None = None
        self._ids: list[str] | None = None
        self._resident: tuple[str, ...] = ()
        self._held = contextlib.ExitStack()

    # --- a request ----------------------------------------------------------------------
    def begin(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        draft: str = "auto",
        k: int | None = None,
        policy: str = "auto",
        messages: list[dict[str, str]] | None = None,
        estimator: AcceptanceEstimator | None = None,
    ) -> None:
        """Start a request: `draft` "none", a draft id (used while resident; loaded now if
        it is not), or "auto": then `policy` decides ("auto": the decision rule)."""
        self.stats = RoundStats()
        self._policy, self._request, self._open, self._build = None, None, None, None
        if draft == "none":
            self._rule = FixedPolicy(None, 0)
            return
        est = estimator or self.estimator
        if draft != "auto" or policy == "auto":

            def build(drafts: list[Draft]) -> RoundPolicy:
                if k is not None:
                    return FixedPolicy(drafts[0] if drafts else None, min(k, self.k_max))
                return DecisionRulePolicy(drafts, self.costs, est, self.k_max)

            self._build, self._rule, self._resident = build, build([]), ()
            self._ids = None if draft == "auto" else [draft]
            if draft != "auto":
                self._held.enter_context(self.ws.holding(draft))  # not a victim while used
                self.ws.acquire(draft, wait=True)
            return
        text, turns = chat_text(messages)
        request = Request("", prompt, text, turns, params.max_tokens)
        self.begin_policy(self.policy(policy), request, estimator)

    def begin_policy(
        self, policy: Policy, request: Request, estimator: AcceptanceEstimator | None = None
    ) -> None:
        """Start a request that `policy` decides (the live policy bench brings its own)."""
        self.stats = RoundStats()
        self._policy, self._request, self._open, self._build = policy, request, None, None
        t = time.thread_time()
        policy.begin(request, self.ws)
        self.stats.policy_s += time.thread_time() - t
        if policy.rounds_by_rule:
            # The policy plans residency and learns; each round is the decision rule's over
            # what is resident, its acceptance estimates starting from the policy's priors
            # for this request (memspec: the predictor's, from the prompt).
            est = estimator or self.rule_estimators.setdefault(policy.name, AcceptanceEstimator())
            for key, alpha in policy.round_priors().items():
                est.set_prior(key, alpha)

            def rule(drafts: list[Draft]) -> RoundPolicy:
                return DecisionRulePolicy(drafts, self.costs, est, self.k_max)

            self._build, self._rule, self._resident, self._ids = rule, rule([]), (), None

    def finish(self) -> RoundStats:
        """Close the last round and end the request (once, after generation)."""
        if self._policy is not None:
            self._close(time.perf_counter())
            t = time.thread_time()
            self._policy.end()
            self.stats.policy_s += time.thread_time() - t
        self.abort()
        return self.stats

    def abort(self) -> None:
        """Let go of the request's drafts (leases, holds) without ending it."""
        self.ws.release_leases()
        self._held.close()
        self._policy = None

    # --- the engine's RoundPolicy -------------------------------------------------------
    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        now = time.perf_counter()
        self._close(now)
        self.ws.release_leases()  # the previous round's proposal is verified by now
        if self._policy is not None and self._build is None:
            return self._choose_by_policy(self._policy, now, context, k_room, params, rng)
        if self._build is not None:
            drafts = self.ws.lease_resident(self._ids)
            resident = tuple(d.id for d in drafts)
            if resident != self._resident:  # rebuilt only when residency changes
                self._rule, self._resident = self._build(drafts), resident
        t = time.thread_time()
        choice = self._rule.choose(context, k_room, params, rng)
        if self._policy is not None and self._request is not None:
            self.stats.policy_s += time.thread_time() - t
            self._open_round(choice, len(context) - len(self._request.prompt), now)
        return choice

    def observe_costs(
        self,
        draft_id: str | None,
        drafted: int,
        draft_s: float,
        gap: int,
        verify_s: float,
        first_s: float = 0.0,
    ) -> None:
        self.costs.observe(draft_id, drafted, draft_s, gap, verify_s, first_s)

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        if self._policy is None or self._build is not None:
            self._rule.observe(key, proposed, accepted, seconds)
        if self._policy is not None and self._open is not None:
            self._open.update(key=key, proposed=proposed, accepted=accepted)

    def _choose_by_policy(
        self,
        policy: Policy,
        now: float,
        context: list[int],
        k_room: int,
        params: SamplingParams,
        rng: np.random.Generator,
    ) -> Choice:
        assert self._request is not None
        position = len(context) - len(self._request.prompt)
        peeks: dict[str, tuple[str, int, Proposal | None, Draft | None]] = {}
        peek_s = 0.0

        def peek(draft_id: str) -> tuple[str, int]:
            nonlocal peek_s
            if draft_id not in peeks:
                t = time.thread_time()
                draft = self.ws.get(draft_id)
                if draft is None:
                    peeks[draft_id] = (draft_id, 0, None, None)
                else:
                    p = draft.propose(context, min(self.k_max, k_room), params, rng)
                    peeks[draft_id] = (p.key or draft_id, len(p.tokens), p, draft)
                peek_s += time.thread_time() - t
            return peeks[draft_id][:2]

        t = time.thread_time()
        draft_id, k = policy.choose(Round(position, k_room, peek), self.ws)
        self.stats.policy_s += time.thread_time() - t - peek_s
        choice = Choice(None, 0)
        if draft_id is not None and k > 0:
            if draft_id in peeks:
                _, n, proposal, draft = peeks[draft_id]
                if proposal is not None and n > 0:
                    proposal.tokens = proposal.tokens[:k]
                    if proposal.probs is not None:
                        proposal.probs = proposal.probs[:k]
                    choice = Choice(draft, min(k, n), proposal)
            else:
                draft = self.ws.get(draft_id)
                if draft is None and policy.reactive:
                    t = time.perf_counter()
                    try:
                        draft = self.ws.acquire(draft_id, wait=True)
                    except MemSpecError:  # cannot fit beside pinned drafts: no draft this round
                        draft = None
                    self.stats.stall_s += time.perf_counter() - t
                if draft is not None:
                    choice = Choice(draft, k)
        self._open_round(choice, position, now)
        return choice

    def _open_round(self, choice: Choice, position: int, now: float) -> None:
        used = choice.draft.id if choice.draft is not None and choice.k > 0 else None
        self._open = {
            "draft": used,
            "key": used or "",
            "position": position,
            "t0": now,
            "proposed": 0,
            "accepted": 0,
        }
        if used is not None:
            self.stats.drafts_used[used] = self.stats.drafts_used.get(used, 0) + 1

    def _close(self, now: float) -> None:
        o, self._open = self._open, None
        if o is None or self._policy is None:
            return
        self.stats.rounds += 1
        drafted = o["proposed"] > 0
        t = time.thread_time()
        self._policy.observe(
            o["draft"] if drafted else None,
            o["key"],
            o["position"],
            o["proposed"],
            o["accepted"],
            now - o["t0"],
            o["accepted"] + 1,
        )
        self.stats.policy_s += time.thread_time() - t

    # --- named policies -----------------------------------------------------------------
    def policy(self, name: str) -> Policy:
        """The named policy's one instance, told the drafts' sizes and load times as the
        working set knows them now."""
        if name not in self.names or name == "auto":
            raise InvalidRequest(
                f"unknown policy {name!r}; known: {', '.join(sorted(self.names))}",
                param="policy",
            )
        for row in self.ws.status():
            size = int(row["bytes"] or 0)
            load_s = row["load_s"]
            if load_s is None:
                load_s = size / FALLBACK_LOAD_BANDWIDTH
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


class LookupRounds:
    """The rounds of a sequence decoded beside others (batched decoding, a slot other than
    the lead's): the decision rule over the resident drafts that propose without forward
    passes of their own (prompt lookup, datastores), re-read every round. Model drafts and
    heads keep one sequence's state (a KV cache, the target's feature at one position), so
    they serve the lead slot only; under load the batch-level rule would seldom pay for their
    serial passes anyway (docs/batching.md). `draft`: "auto", "none", or a draft id (used
    here only if it is such a draft)."""

    def __init__(
        self,
        working_set: WorkingSet,
        costs: CostModel,
        estimator: AcceptanceEstimator,
        k_max: int,
        draft: str = "auto",
    ):
        self.ws, self.costs, self.estimator, self.k_max = working_set, costs, estimator, k_max
        self._ids = None if draft in ("auto", "none") else [draft]
        self._off = draft == "none"
        self._rule: RoundPolicy = FixedPolicy(None, 0)
        self._resident: tuple[str, ...] = ()

    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        if self._off:
            return Choice(None, 0)
        drafts = [d for d in self.ws.lease_resident(self._ids) if d.free]
        resident = tuple(d.id for d in drafts)
        if resident != self._resident:  # rebuilt only when residency changes
            self._rule = DecisionRulePolicy(drafts, self.costs, self.estimator, self.k_max)
            self._resident = resident
        return self._rule.choose(context, k_room, params, rng)

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        self._rule.observe(key, proposed, accepted, seconds)

    def observe_costs(
        self,
        draft_id: str | None,
        drafted: int,
        draft_s: float,
        gap: int,
        verify_s: float,
        first_s: float = 0.0,
    ) -> None:
        self.costs.observe(draft_id, drafted, draft_s, gap, verify_s, first_s)
