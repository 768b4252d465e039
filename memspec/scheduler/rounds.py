"""Run a scheduling Policy inside the live engine: the engine's RoundPolicy for one request.

A round is timed from one choose() to the next, so its reward includes everything the round
cost (drafting, verification, any wait on a reactive load). Cheap proposers are only asked
(peeked) when the policy looks at them. Time spent inside the policy itself, minus the peeks,
is the scheduling overhead reported per round, in this thread's CPU time (a busy machine's
preemptions would otherwise be charged to the policy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memspec.drafts.base import Draft, Proposal
from memspec.engine.policy import Choice
from memspec.errors import MemSpecError
from memspec.scheduler.policies import Policy, Request, Round


@dataclass
class RoundStats:
    rounds: int = 0
    policy_s: float = 0.0  # CPU s inside begin/choose/observe/end, peeks excluded
    stall_s: float = 0.0  # waiting on reactive loads
    drafts_used: dict[str, int] = field(default_factory=dict)


class PolicyRounds:
    """Adapter: Policy (ids, residency) -> engine RoundPolicy (Draft objects) for one request.

    `ws` is the working set: resident_ids(), get(id), acquire(id, wait=True), prefetch(...).
    """

    def __init__(self, policy: Policy, ws, request: Request, k_max: int):
        self.policy = policy
        self.ws = ws
        self.request = request
        self.k_max = k_max
        self.stats = RoundStats()
        self._open: dict | None = None
        t = time.thread_time()
        policy.begin(request, ws)
        self.stats.policy_s += time.thread_time() - t

    def choose(self, context, k_room, params, rng) -> Choice:
        now = time.perf_counter()
        self._close(now)
        # Round boundary: drafts leased last round may now be closed if they were evicted.
        release = getattr(self.ws, "release_leases", None)
        if release is not None:
            release()
        position = len(context) - len(self.request.prompt)
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
        draft_id, k = self.policy.choose(Round(position, k_room, peek), self.ws)
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
                if draft is None and self.policy.reactive:
                    t = time.perf_counter()
                    try:
                        draft = self.ws.acquire(draft_id, wait=True)
                    except MemSpecError:  # cannot fit beside pinned drafts: no draft this round
                        draft = None
                    self.stats.stall_s += time.perf_counter() - t
                if draft is not None:
                    choice = Choice(draft, k)
        self._open = {
            "draft": choice.draft.id if choice.draft is not None else None,
            "key": choice.draft.id if choice.draft is not None else "",
            "position": position,
            "t0": now,
            "proposed": 0,
            "accepted": 0,
        }
        if choice.draft is not None:
            used = self.stats.drafts_used
            used[choice.draft.id] = used.get(choice.draft.id, 0) + 1
        return choice

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        if self._open is not None:
            self._open.update(key=key, proposed=proposed, accepted=accepted)

    def _close(self, now: float) -> None:
        o, self._open = self._open, None
        if o is None:
            return
        self.stats.rounds += 1
        drafted = o["proposed"] > 0
        t = time.thread_time()
        self.policy.observe(
            o["draft"] if drafted else None,
            o["key"],
            o["position"],
            o["proposed"],
            o["accepted"],
            now - o["t0"],
            o["accepted"] + 1,
        )
        self.stats.policy_s += time.thread_time() - t

    def finish(self) -> RoundStats:
        """Close the last round and end the request (call once, after generation)."""
        self._close(time.perf_counter())
        t = time.thread_time()
        self.policy.end()
        self.stats.policy_s += time.thread_time() - t
        release = getattr(self.ws, "release_leases", None)
        if release is not None:
            release()
        return self.stats
