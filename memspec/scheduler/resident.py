"""The engine's side of the working set: rounds that use only resident drafts, safely.

A draft handed to the engine is leased to the engine's thread (see WorkingSet), so an
eviction cannot close it while it proposes. RoundLeases drops the previous round's leases when
the next round starts; Runtime.generate drops the last ones when the request ends. Any
RoundPolicy can be wrapped; ResidentRounds also re-reads residency every round, so a draft
that finishes loading mid-request is used from the next round on, and one that is evicted
simply stops being offered (the round decodes without it: output unchanged).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memspec.drafts.base import Draft
from memspec.engine.policy import Choice, RoundPolicy
from memspec.engine.sampling import SamplingParams
from memspec.scheduler.working_set import WorkingSet


class RoundLeases:
    """Wrap a RoundPolicy: release this thread's draft leases at every round boundary."""

    def __init__(self, ws: WorkingSet, inner: RoundPolicy):
        self.ws = ws
        self.inner = inner

    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice:
        self.ws.release_leases()  # the previous round's proposal is verified by now
        return self.inner.choose(context, k_room, params, rng)

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None:
        self.inner.observe(key, proposed, accepted, seconds)

    def finish(self):  # noqa: ANN201 - whatever the inner policy reports
        self.ws.release_leases()
        fin = getattr(self.inner, "finish", None)
        return fin() if fin is not None else None


class ResidentRounds(RoundLeases):
    """Each round, build (or reuse) a policy over the drafts resident now.

    `build(drafts)` makes the inner policy, e.g. a DecisionRulePolicy; it is rebuilt only
    when the resident set changes. `ids` limits the drafts considered (a request that named
    one draft); None: every resident draft.
    """

    def __init__(
        self,
        ws: WorkingSet,
        build: Callable[[list[Draft]], RoundPolicy],
        ids: list[str] | None = None,
    ):
        super().__init__(ws, build([]))
        self.build = build
        self.ids = ids
        self._key: tuple[str, ...] = ()

    def choose(self, context, k_room, params, rng) -> Choice:
        self.ws.release_leases()
        drafts = self.ws.lease_resident(self.ids)
        key = tuple(d.id for d in drafts)
        if key != self._key:
            self.inner, self._key = self.build(drafts), key
        return self.inner.choose(context, k_room, params, rng)
