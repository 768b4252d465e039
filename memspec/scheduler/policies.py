"""Scheduling policies: each round's (draft, k), and what the working set should hold.

One interface: every policy is an engine RoundPolicy itself (`choose`, `observe`,
`observe_costs`), per request `begin` and `end`; memspec.scheduler.rounds.Scheduler picks the
request's policy and hands it to the engine, over the real WorkingSet in the daemon and over the
simulator's SimWorkingSet and trace-backed drafts in the lab (memspec_lab.sim): the same code
chooses a live and a simulated round. A policy sees drafts by id, the device's measured costs,
the working set's residency, and for free proposers (prompt lookup, ...) a peek at what they
would propose now. Its own decision is `select_draft` (draft id, k) and its learning
`record_round`, both per round; `Policy.choose` and `Policy.observe` wrap them (peeks, reactive
loads, the round's time from one choice to the next), once for all of them.

- `auto`        the decision rule over the resident drafts (RulePolicy), re-read every round.
- `none`        plain target decoding.
- `fixed:<id>`  always that draft, k by the decision rule (at least 1); loaded on first use.
- `ucb`, `exp3` BanditSpec-style bandits over {none} ∪ drafts; reward = the round's measured
                tokens/s (load stalls included); a chosen draft that is not resident is loaded
                reactively, and the engine waits for it.
- `memspec`     plans what the working set holds, proactively, by predicted seconds saved per
                byte; its rounds are `auto`'s (it is a RulePolicy), its acceptance estimates
                primed with the predictor's α for the prompt; decoding never waits for a load.
- `oracle`      knows from traces which single draft is best for each prompt and its actual
                acceptance (comparison only); same prefetch mechanism as memspec.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from memspec.drafts.registry import PRIOR_ALPHA  # the priors the engine's estimator uses
from memspec.engine.costs import AcceptanceEstimator, CostModel, RoundCosts
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy
from memspec.engine.types import Choice, Draft, Proposal, RoundPolicy, SamplingParams
from memspec.errors import MemSpecError
from memspec.memory.fill import fill_by_value
from memspec.predictor.model import AcceptancePredictor, RequestState


class Residency(Protocol):
    """A working set, live or simulated: a policy plans with the first three and takes its
    round's drafts with the rest (leased to the engine's thread until the round ends)."""

    budget_bytes: int  # reserved_bytes (the target), if the set has it, is not draft room

    def resident_ids(self) -> set[str]: ...
    def prefetch(self, wanted: list[tuple[str, float]]) -> None: ...
    def get(self, draft_id: str) -> Draft | None: ...
    def lease_resident(self, ids: Iterable[str] | None = None) -> list[Draft]: ...
    def acquire(self, draft_id: str, wait: bool = True) -> Draft | None: ...
    def leased(self) -> AbstractContextManager[None]: ...
    def holding(self, *ids: str) -> AbstractContextManager[None]: ...


LOOKUP_KINDS = frozenset({"prompt_lookup", "datastore"})


@dataclass(frozen=True)
class DraftInfo:
    id: str
    kind: str
    bytes: int  # resident footprint; 0: nothing to load (always_resident)
    load_s: float = 0.0  # expected seconds of one load on this device
    shares_target_kv: bool = False  # a self-draft that copies the target's KV (no catch-up)

    @property
    def free(self) -> bool:
        """Proposes without a forward pass of its own (Draft.free: lookups), so it is asked
        (peeked) before choosing: cheap and deterministic, its proposal length says whether
        it applies. (A head samples its proposal: asking it before choosing would make what
        is verified depend on what was drawn, and cost every round.)"""
        return self.kind in LOOKUP_KINDS

    @property
    def catches_up(self) -> bool:
        """A model draft's KV cache trails the context and pays to catch up (a head starts
        from the target's own feature, a lookup from the context, a self-draft from a copy of
        the target's KV cache)."""
        return self.kind == "model" and not self.shares_target_kv

    @property
    def always_resident(self) -> bool:
        """Has nothing to load (a lookup over the context; not the same as free: a datastore
        is free to ask but has a table to load)."""
        return self.bytes == 0


@dataclass
class Env:
    """What every policy knows about the device and the pool."""

    drafts: dict[str, DraftInfo]
    costs: CostModel
    k_max: int = 8


@dataclass
class Request:
    id: str
    prompt: list[int]
    text: str = ""  # the last user message
    turns: int = 1
    max_tokens: int = 128


@dataclass
class Round:
    position: int  # output tokens so far
    k_room: int  # most draft tokens this round may verify
    peek: Callable[[str], tuple[str, int]]  # draft id -> (statistic key, tokens it proposes)


@dataclass
class RoundStats:
    """A request's rounds as its policy saw them (what the simulator and the live bench add up)."""

    rounds: int = 0
    policy_s: float = 0.0  # CPU s inside begin/choose/record_round/end, peeks excluded
    stall_s: float = 0.0  # waiting on reactive loads
    drafts_used: dict[str, int] = field(default_factory=dict)


@dataclass
class OpenRound:
    """The round between a choice and the next: what record_round() is told."""

    draft: str | None
    position: int
    t0: float
    key: str = ""
    proposed: int = 0
    accepted: int = 0


# One peeked proposal: (statistic key, tokens, the proposal, the draft); None: not resident.
Peek = tuple[str, int, Proposal | None, Draft | None]


class Policy:
    """A named policy, one request at a time: `begin`, then per round the engine's `choose`
    and `observe` (it is a RoundPolicy), then `end`. A policy decides in `select_draft` and
    learns in `record_round`; `choose` peeks free drafts for it, loads a reactive policy's
    pick, and times each round from its choice to the next (so the reward includes all it
    cost: drafting, verification, waits on loads). Time inside it, peeks excluded, is the
    scheduling overhead (stats.policy_s), in this thread's CPU time."""

    name: str = "policy"
    # True: a chosen draft that is not resident is loaded on demand and the round waits.
    reactive: bool = False

    def __init__(self, env: Env):
        self.env = env
        self.ws: Residency | None = None
        self.req: Request | None = None
        self.stats = RoundStats()
        self.clock: Callable[[], float] = time.perf_counter  # the simulator's is virtual
        self.open: OpenRound | None = None

    @property
    def r_none(self) -> float:
        """Plain decoding's rate now (the costs follow what rounds measure)."""
        return self.env.costs.rate(None, 0.0, 0)

    def begin(
        self,
        req: Request,
        ws: Residency,
        stats: RoundStats | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """A request starts: its rounds are counted in `stats`, timed by `clock`."""
        self.req, self.ws, self.open = req, ws, None
        self.stats = stats if stats is not None else RoundStats()
        self.clock = clock or self.clock
        t = time.thread_time()
        self.start(req, ws)
        self.stats.policy_s += time.thread_time() - t

    def start(self, req: Request, ws: Residency) -> None:
        """The policy's own start of a request: read its prompt, tell the set what to hold."""

    # --- the engine's RoundPolicy -------------------------------------------------------
    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        """This round's (draft, k); the round before it ends here (record_round)."""
        now = self.clock()
        self.close(now)
        position = len(context) - (len(self.req.prompt) if self.req is not None else 0)
        choice = self.decide(position, context, k_room, params, rng)
        used = choice.draft.id if choice.draft is not None and choice.k > 0 else None
        self.open = OpenRound(used, position, now, key=used or "")
        if used is not None:
            self.stats.drafts_used[used] = self.stats.drafts_used.get(used, 0) + 1
        return choice

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        """The round's verified proposal (the engine calls it only for rounds that drafted)."""
        if self.open is not None:
            self.open.key, self.open.proposed, self.open.accepted = key, proposed, accepted

    def observe_costs(self, measured: RoundCosts) -> None:
        self.env.costs.observe(measured)

    def close(self, now: float) -> None:
        """The round in flight is over at `now`: record_round() is told."""
        o, self.open = self.open, None
        if o is None:
            return
        self.stats.rounds += 1
        t = time.thread_time()
        draft = o.draft if o.proposed > 0 else None
        self.record_round(
            draft, o.key, o.position, o.proposed, o.accepted, now - o.t0, o.accepted + 1
        )
        self.stats.policy_s += time.thread_time() - t

    def finish(self) -> RoundStats:
        """The request ends: its last round closed, then end()."""
        self.close(self.clock())
        t = time.thread_time()
        self.end()
        self.stats.policy_s += time.thread_time() - t
        return self.stats

    def decide(
        self,
        position: int,
        context: list[int],
        k_room: int,
        params: SamplingParams,
        rng: np.random.Generator,
    ) -> Choice:
        """select_draft's pick as a Choice: a peeked proposal reused, a reactive load waited on."""
        ws, k_max = self.ws, self.env.k_max
        assert ws is not None, "begin() first"
        peeks: dict[str, Peek] = {}
        peek_s = 0.0

        def peek(draft_id: str) -> tuple[str, int]:
            nonlocal peek_s
            if draft_id not in peeks:
                t = time.thread_time()
                draft = ws.get(draft_id)
                if draft is None:
                    peeks[draft_id] = (draft_id, 0, None, None)
                else:
                    p = draft.propose(context, min(k_max, k_room), params, rng)
                    peeks[draft_id] = (p.key or draft_id, len(p.tokens), p, draft)
                peek_s += time.thread_time() - t
            return peeks[draft_id][:2]

        t = time.thread_time()
        draft_id, k = self.select_draft(Round(position, k_room, peek), ws)
        self.stats.policy_s += time.thread_time() - t - peek_s
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
        draft = ws.get(draft_id)
        if draft is None and self.reactive:
            t = self.clock()
            try:
                draft = ws.acquire(draft_id, wait=True)
            except MemSpecError:  # cannot fit beside pinned drafts: no draft this round
                draft = None
            self.stats.stall_s += self.clock() - t
        return Choice(draft, k) if draft is not None else Choice(None, 0)

    # --- what each policy decides and learns ---------------------------------------------
    def select_draft(self, rnd: Round, ws: Residency) -> tuple[str | None, int]:
        """(draft id, k) for this round; (None, 0) decodes one token without a draft."""
        raise NotImplementedError(self.name)

    def record_round(
        self,
        draft: str | None,
        key: str,
        position: int,
        proposed: int,
        accepted: int,
        seconds: float,
        tokens: int,
    ) -> None:
        """One verified round: what was proposed/accepted, its wall time and tokens emitted."""

    def end(self) -> None:
        """The request finished."""

    def status(self) -> dict:
        return {"policy": self.name}


class RulePolicy(Policy):
    """`auto`: the decision rule over the drafts resident now (`ids`: only those; `free_only`:
    only drafts that propose without a forward pass of their own), rebuilt when residency
    changes, so a draft loaded mid-request is used from the next round and one evicted stops
    being offered (output unchanged). `k`: a fixed k for the first of them instead of the
    rule's. Its acceptance is learnt in `estimator`, kept across the requests it is given to."""

    name = "auto"

    def __init__(
        self,
        env: Env,
        estimator: AcceptanceEstimator | None = None,
        ids: list[str] | None = None,
        free_only: bool = False,
        k: int | None = None,
    ):
        super().__init__(env)
        self.estimator = estimator if estimator is not None else AcceptanceEstimator()
        self.ids, self.free_only, self.k = ids, free_only, k
        self._rule: RoundPolicy = FixedPolicy(None, 0)
        self._resident: tuple[str, ...] | None = None

    def start(self, req: Request, ws: Residency) -> None:
        self._resident = None  # the rule is rebuilt on this request's estimator

    def decide(self, position, context, k_room, params, rng) -> Choice:
        assert self.ws is not None, "begin() first"
        t = time.thread_time()
        drafts = self.ws.lease_resident(self.ids)
        if self.free_only:
            drafts = [d for d in drafts if d.free]
        resident = tuple(d.id for d in drafts)
        if resident != self._resident:  # rebuilt only when residency changes
            self._resident, k_max = resident, self.env.k_max
            if self.k is not None:
                self._rule = FixedPolicy(drafts[0] if drafts else None, min(self.k, k_max))
            else:
                self._rule = DecisionRulePolicy(drafts, self.env.costs, self.estimator, k_max)
        choice = self._rule.choose(context, k_room, params, rng)
        self.stats.policy_s += time.thread_time() - t
        return choice

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        self._rule.observe(key, proposed, accepted, seconds)
        super().observe(key, proposed, accepted, seconds)


def _limit(info: DraftInfo, rnd: Round, k_max: int) -> tuple[str, int]:
    """The statistic key and the most tokens this draft can propose this round."""
    if info.free:
        key, n = rnd.peek(info.id)
        return key, min(n, rnd.k_room, k_max)
    return info.id, min(k_max, rnd.k_room)


def _tried(
    info: DraftInfo, rnd: Round, env: Env, est: AcceptanceEstimator
) -> tuple[str | None, int]:
    """A draft that must be tried: k by the rule on its running acceptance, at least 1."""
    key, limit = _limit(info, rnd, env.k_max)
    k, _ = env.costs.best_k(info.id, est.alpha(key), limit, est.alpha_cont(key), force=True)
    return (info.id, k) if k > 0 else (None, 0)


def _estimator(env: Env) -> AcceptanceEstimator:
    est = AcceptanceEstimator()
    for d in env.drafts.values():
        est.set_prior(d.id, PRIOR_ALPHA.get(d.kind, 0.5))
    return est


class NonePolicy(Policy):
    name = "none"

    def select_draft(self, rnd, ws):
        return None, 0


class FixedDraftPolicy(Policy):
    """One draft for every round; k from the decision rule on its running acceptance."""

    reactive = True

    def __init__(self, env: Env, draft: str):
        super().__init__(env)
        if draft not in env.drafts:
            raise ValueError(f"fixed:{draft}: unknown draft; known: {', '.join(env.drafts)}")
        self.info = env.drafts[draft]
        self.name = f"fixed:{draft}"
        self.est = _estimator(env)

    def select_draft(self, rnd, ws):
        return _tried(self.info, rnd, self.env, self.est)

    def record_round(self, draft, key, position, proposed, accepted, seconds, tokens):
        if draft is not None:
            self.est.update(key, proposed, accepted)


class _Bandit(Policy, ABC):
    """Arms: none and each draft. k per draft arm by the decision rule on the arm's observed
    acceptance (at least 1, so the arm is really tried). Rewards are the round's measured
    tokens/s over the best seen so far, in [0, 1]."""

    reactive = True

    def __init__(self, env: Env, seed: int = 0):
        super().__init__(env)
        self.arms: list[str | None] = [None, *env.drafts]
        self.est = _estimator(env)
        self.rng = random.Random(seed)
        self.r_max = 2.0 * self.r_none
        self.arm: int = 0  # the arm of the round in flight
        self.plays = [0] * len(self.arms)

    @abstractmethod
    def pick(self) -> int: ...

    @abstractmethod
    def reward(self, arm: int, r: float) -> None: ...

    def select_draft(self, rnd, ws):
        self.arm = self.pick()
        draft = self.arms[self.arm]
        return _tried(self.env.drafts[draft], rnd, self.env, self.est) if draft else (None, 0)

    def record_round(self, draft, key, position, proposed, accepted, seconds, tokens):
        if draft is not None:
            self.est.update(key, proposed, accepted)
        r = tokens / max(seconds, 1e-6)
        self.r_max = max(self.r_max, r)
        self.plays[self.arm] += 1
        self.reward(self.arm, r / self.r_max)

    def status(self) -> dict:
        plays = {str(a): n for a, n in zip(self.arms, self.plays, strict=True)}
        return {"policy": self.name, "plays": plays}


class UCBPolicy(_Bandit):
    """UCB1: play each arm once, then the arm maximising mean + sqrt(2 ln t / n)."""

    name = "ucb"

    def __init__(self, env: Env, seed: int = 0, c: float = math.sqrt(2.0)):
        super().__init__(env, seed)
        self.c = c
        self.sums = [0.0] * len(self.arms)

    def pick(self) -> int:
        if 0 in self.plays:  # each arm once first
            return self.plays.index(0)
        log_t = math.log(sum(self.plays))
        scores = [
            s / n + self.c * math.sqrt(log_t / n)
            for s, n in zip(self.sums, self.plays, strict=True)
        ]
        return max(range(len(scores)), key=scores.__getitem__)

    def reward(self, arm: int, r: float) -> None:
        self.sums[arm] += r


class EXP3Policy(_Bandit):
    """EXP3: sample from exponential weights mixed with γ uniform exploration."""

    name = "exp3"

    def __init__(self, env: Env, seed: int = 0, gamma: float = 0.1):
        super().__init__(env, seed)
        self.gamma = gamma
        self.logw = [0.0] * len(self.arms)
        self.probs = [1.0 / len(self.arms)] * len(self.arms)

    def pick(self) -> int:
        top = max(self.logw)
        w = [math.exp(x - top) for x in self.logw]
        total = sum(w)
        n = len(w)
        self.probs = [(1 - self.gamma) * x / total + self.gamma / n for x in w]
        return self.rng.choices(range(n), weights=self.probs)[0]

    def reward(self, arm: int, r: float) -> None:
        self.logw[arm] += self.gamma * (r / self.probs[arm]) / len(self.arms)


class MemSpecPolicy(RulePolicy):
    """Predictor α + decision rule among resident drafts + proactive residency by value/byte.

    Value of holding draft d = seconds it is predicted to save on the rest of this request
    (tokens left × (1/rate_none − 1/rate_d), less the catch-up of its KV cache on the context
    so far), plus what it saved per request lately times the number of further requests it is
    expected to stay the right choice (requests come in runs; the run length is learnt from
    how often the best draft changed between requests), minus its load time when it is not
    resident yet. The working set keeps the most valuable draft, then the best value per byte
    that fits; loads run in the background while decoding goes on with what is resident.
    Its rounds are the decision rule's over the resident drafts (a RulePolicy's), primed with
    the predictor's α for this prompt (round_priors); it learns from what they observe."""

    name = "memspec"

    def __init__(
        self,
        env: Env,
        predictor: AcceptancePredictor,
        replan_every: int = 16,
        recent_decay: float = 0.5,
        horizon_cap: float = 8.0,
    ):
        super().__init__(env)
        self.predictor = predictor
        for d in env.drafts.values():
            predictor.set_prior(d.id, PRIOR_ALPHA.get(d.kind, 0.5))
        self.replan_every = replan_every
        self.recent_decay = recent_decay
        self.horizon_cap = horizon_cap
        self.switch_rate = 0.5  # how often the best draft changes from one request to the next
        self.last_best: str | None = None
        self.state: RequestState | None = None
        self.ws: Residency | None = None
        self.req: Request | None = None
        self.rounds = 0
        self.position = 0
        self.mean_len = 0.0  # running mean output length (tokens)
        self.recent: dict[str, float] = {}  # seconds saved per token on recent requests
        self.plan: dict[str, float] = {}
        self.seen: dict[str, int] = {}  # context tokens each model draft's KV holds (this request)
        self.mean_prompt = 0.0

    def _tokens_left(self, position: int) -> float:
        assert self.req is not None
        expect = self.mean_len or self.req.max_tokens * 0.75
        return max(min(expect, self.req.max_tokens) - position, 0.0)

    def _gap(self, draft: str, position: int) -> int:
        """Context tokens the draft would have to catch up on before proposing."""
        assert self.req is not None
        return len(self.req.prompt) + position - self.seen.get(draft, 0)

    def saved_per_token(self, draft: str, position: int) -> float:
        """Predicted seconds the draft saves per generated token, its rule-best k assumed."""
        assert self.state is not None
        alpha = self.predictor.alpha(self.state, draft, position)
        k, rate = self.env.costs.best_k(draft, alpha, self.env.k_max)
        return max(1.0 / self.r_none - 1.0 / rate, 0.0) if k > 0 else 0.0

    def value(
        self,
        draft: DraftInfo,
        position: int,
        resident: set[str],
        idle: bool = False,
        at_hand: float = 0.0,
    ) -> float:
        """Predicted seconds saved by holding `draft`: on this request (net of catch-up) and on
        the further requests it is expected to stay useful for.

        A load while a request decodes is paid by that request (the loader competes for its
        cores: a fresh process's first request ran at 0.5-0.9x plain while four drafts loaded)
        and helps it only once done, and only by what it saves beyond the best draft already at
        hand (`at_hand`, seconds per token: one draft runs per round). So a draft not resident is
        loaded then only for that gain on the tokens left after its load; for later requests it
        is loaded when the request ends (`idle`)."""
        assert self.req is not None
        per_token = self.saved_per_token(draft.id, position)
        catch = self.env.costs.catchup_s(draft.id)
        prompt = self.mean_prompt or len(self.req.prompt)
        per_request = per_token * (self.mean_len or 64.0) - catch * prompt
        later = max(self.recent.get(draft.id, per_request) * self.horizon, 0.0)
        if draft.id in resident:
            left = 0.0 if idle else self._tokens_left(position)
            now = per_token * left - catch * self._gap(draft.id, position) if left else 0.0
            return max(now, 0.0) + later
        if idle:
            return later - draft.load_s
        left = max(self._tokens_left(position) - draft.load_s * self.r_none, 0.0)
        gain = (per_token - at_hand) * left - catch * self._gap(draft.id, position)
        return max(gain, 0.0) - draft.load_s

    @property
    def horizon(self) -> float:
        """Further requests a draft is expected to stay useful: (1 − p) / p for switch rate p."""
        p = max(self.switch_rate, 1.0 / (self.horizon_cap + 1))
        return (1 - p) / p

    def replan(self, position: int, idle: bool = False) -> None:
        """Tell the working set what to hold. Only one draft runs per round, so holding two is
        worth about the better one: the draft with the most predicted value goes first (not the
        densest, which could crowd it out of a one-draft budget), then the rest of the room is
        filled by value per byte (drafts the next requests may want)."""
        ws = self.ws
        assert ws is not None
        resident = ws.resident_ids()
        drafts = [d for d in self.env.drafts.values() if not d.always_resident]
        ready = [d.id for d in self.env.drafts.values() if d.always_resident or d.id in resident]
        saved = [] if idle else [self.saved_per_token(i, position) for i in ready]
        at_hand = max(saved, default=0.0)  # seconds per token of the best draft at hand
        values = {d.id: self.value(d, position, resident, idle, at_hand) for d in drafts}
        if not idle:  # one load at a time while a request decodes: the most valuable
            loads = sorted((v, i) for i, v in values.items() if i not in resident and v > 0)
            values.update({i: 0.0 for _, i in loads[:-1]})
        room = ws.budget_bytes - getattr(ws, "reserved_bytes", 0)
        held = fill_by_value([(d.id, values[d.id], d.bytes) for d in drafts], room, top_first=True)
        self.plan = {i: values[i] for i in held}
        ws.prefetch(list(self.plan.items()))

    def start(self, req, ws):
        super().start(req, ws)
        self.state = self.predictor.request(req.prompt, req.text, req.turns)
        self.rounds = self.position = 0
        self.seen = {}
        n = len(req.prompt)
        self.mean_prompt = n if not self.mean_prompt else 0.8 * self.mean_prompt + 0.2 * n
        self.replan(0)
        for key, alpha in self.round_priors().items():  # the rule's rounds start from them
            self.estimator.set_prior(key, alpha)

    def round_priors(self) -> dict[str, float]:
        """The predictor's α for this request's prompt, per draft and per statistic key."""
        state = self.state
        if state is None:
            return {}
        keys = set(self.env.drafts) | {
            k for k in self.predictor.keys if k.split("/")[0] in self.env.drafts
        }
        return {k: self.predictor.prior_alpha(state, k, 0) for k in sorted(keys)}

    def record_round(self, draft, key, position, proposed, accepted, seconds, tokens):
        self.position = position
        if draft is None or self.state is None or self.req is None:
            return
        if self.env.drafts[draft].catches_up:  # its KV now holds the context up to here
            self.seen[draft] = len(self.req.prompt) + position + min(accepted, proposed - 1)
        self.predictor.update(self.state, key, position, proposed, accepted)
        self.rounds += 1
        if self.rounds % self.replan_every == 0:
            self.replan(position + tokens)

    def end(self) -> None:
        if self.state is None:
            return
        n = self.position + 1
        self.mean_len = n if not self.mean_len else 0.8 * self.mean_len + 0.2 * n
        # What each draft would have saved per token on this request, as now estimated.
        best, best_saved = None, 0.0
        for d in self.env.drafts.values():
            if d.always_resident:
                continue
            # Net seconds it would have saved on this request, catch-up of the prompt paid.
            catchup = self.env.costs.catchup_s(d.id) * len(self.req.prompt) if d.catches_up else 0
            saved = self.saved_per_token(d.id, 0) * n - catchup
            prev = self.recent.get(d.id, saved)
            self.recent[d.id] = self.recent_decay * prev + (1 - self.recent_decay) * saved
            if saved > best_saved:
                best, best_saved = d.id, saved
        self.switch_rate = 0.8 * self.switch_rate + 0.2 * (best != self.last_best)
        self.last_best = best
        if self.ws is not None:  # what the next requests want loads in the gap before them
            self.replan(n, idle=True)
        self.state = None

    def status(self) -> dict:
        return {
            "policy": self.name,
            "plan": {k: round(v, 4) for k, v in self.plan.items()},
            "horizon_requests": round(self.horizon, 2),
            "predictor": self.predictor.describe(),
        }


@dataclass
class OracleEntry:
    draft: str | None  # the best single draft for this prompt (None: plain decoding wins)
    alpha: dict[str, float] = field(default_factory=dict)  # actual α per statistic key


def prompt_key(prompt: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()[:20]


class OraclePolicy(Policy):
    """Best single draft per prompt, from traces, with its actual acceptance (not deployable)."""

    name = "oracle"

    def __init__(self, env: Env, table: dict[str, OracleEntry]):
        super().__init__(env)
        self.table = table
        self.entry: OracleEntry | None = None
        self.misses = 0

    def start(self, req, ws):
        self.entry = self.table.get(prompt_key(req.prompt))
        if self.entry is None:
            self.misses += 1
            return
        d = self.entry.draft
        wanted = [(d, 1.0)] if d is not None and not self.env.drafts[d].always_resident else []
        ws.prefetch(wanted)

    def select_draft(self, rnd, ws):
        if self.entry is None or self.entry.draft is None:
            return None, 0
        info = self.env.drafts[self.entry.draft]
        if not info.always_resident and info.id not in ws.resident_ids():
            return None, 0
        key, limit = _limit(info, rnd, self.env.k_max)
        alpha = self.entry.alpha.get(key, self.entry.alpha.get(info.id, 0.0))
        k, _ = self.env.costs.best_k(info.id, alpha, limit)
        return (info.id, k) if k > 0 else (None, 0)

    def status(self) -> dict:
        return {"policy": self.name, "misses": self.misses}


POLICY_NAMES = ("none", "fixed:<id>", "ucb", "exp3", "memspec", "oracle")


def make_policy(
    spec: str,
    env: Env,
    predictor: AcceptancePredictor | None = None,
    oracle: dict[str, OracleEntry] | None = None,
    seed: int = 0,
) -> Policy:
    """Build a policy from its name: none, fixed:<id>, ucb, exp3, memspec, oracle."""
    if spec == "none":
        return NonePolicy(env)
    if spec.startswith("fixed:"):
        return FixedDraftPolicy(env, spec.split(":", 1)[1])
    if spec == "ucb":
        return UCBPolicy(env, seed)
    if spec == "exp3":
        return EXP3Policy(env, seed)
    if spec == "memspec":
        return MemSpecPolicy(env, predictor or AcceptancePredictor.fallback("no predictor given"))
    if spec == "oracle":
        if oracle is None:
            raise ValueError("policy 'oracle' needs traces (the best draft per prompt)")
        return OraclePolicy(env, oracle)
    raise ValueError(f"unknown policy {spec!r}; one of {', '.join(POLICY_NAMES)}")
