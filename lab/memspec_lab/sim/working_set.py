"""A working set in virtual time: the simulator's stand-in for the real one.

Same contract as memspec.scheduler.working_set.WorkingSet as far as the Scheduler and its
policies see it: `prefetch(values)` holds the highest value-per-byte set that fits, loading in
the background (one loader, loads in sequence) and evicting what the new plan does not hold;
`acquire(id)` is a reactive load that the caller waits for (stall), evicting the least
recently used draft if it must; `get` and `lease_resident` hand out the request's drafts
(`drafts`, set per request: the simulator's trace-backed ones) that are resident. The budget
here is for drafts only (the target is resident beside it), and a load reserves its bytes
when it starts, so the budget holds at every instant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from memspec.engine.types import Draft
from memspec.memory.fill import fill_by_value


@dataclass
class _Load:
    draft: str
    start: float
    done: float


class SimWorkingSet:
    def __init__(self, budget_bytes: int, sizes: dict[str, int], load_s: dict[str, float]):
        self.budget_bytes = budget_bytes
        self.reserved_bytes = 0  # the target lives beside this budget
        self.sizes = sizes
        self.load_times = load_s
        self.now = 0.0
        self.resident: dict[str, float] = {}  # id -> last use time (LRU for reactive loads)
        self.queue: list[_Load] = []  # background loads: first one in flight
        self.plan: dict[str, float] = {}
        self.stall_s = 0.0
        self.loads = 0
        self.evictions = 0
        self.peak_bytes = 0
        self.load_busy_s = 0.0  # seconds a background load was running
        self.drafts: dict[str, Draft] = {}  # the request's drafts, by id

    # --- the drafts, as the Scheduler asks for them ---------------------------------------
    def _available(self, draft: str) -> bool:
        return draft in self.resident or self.sizes.get(draft, 1) == 0

    def get(self, draft: str) -> Draft | None:
        """The draft if resident now (a draft with nothing to load always is)."""
        return self.drafts.get(draft) if self._available(draft) else None

    def lease_resident(self, ids: Iterable[str] | None = None) -> list[Draft]:
        """The resident drafts (or those of `ids`): those with nothing to load, then the
        others in load order, as the live set gives them."""
        order = dict.fromkeys([d for d in self.drafts if self.sizes.get(d, 1) == 0])
        order.update(dict.fromkeys(self.resident))
        wanted = self.drafts.keys() if ids is None else set(ids)
        return [self.drafts[d] for d in order if d in wanted and d in self.drafts]

    @contextlib.contextmanager
    def leased(self) -> Iterator[None]:
        """Nothing is leased in virtual time: a round's scope holds nothing."""
        yield

    @contextlib.contextmanager
    def holding(self, *ids: str) -> Iterator[None]:
        """Nothing is evicted under a request here but by its own policy's plan."""
        yield

    # --- time -------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Complete the background loads that are done by `now`."""
        while self.queue and self.queue[0].done <= now:
            ld = self.queue.pop(0)
            self.resident[ld.draft] = ld.done
        self.now = max(self.now, now)

    def loading(self) -> bool:
        return bool(self.queue) and self.queue[0].start <= self.now < self.queue[0].done

    # --- accounting -------------------------------------------------------------------
    def used_bytes(self) -> int:
        return sum(self.sizes[d] for d in self.resident) + sum(
            self.sizes[ld.draft] for ld in self.queue
        )

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.used_bytes())

    def resident_ids(self):
        """Set-like view of the resident drafts (no copy: asked every simulated round)."""
        return self.resident.keys()

    def _evict(self, draft: str) -> None:
        if self.resident.pop(draft, None) is not None:
            self.evictions += 1

    def _make_room(self, need: int, keep: set[str], order) -> bool:
        """Evict (in `order`) drafts not in `keep` until `need` more bytes fit."""
        if need > self.budget_bytes:
            return False
        for d in order:
            if self.used_bytes() + need <= self.budget_bytes:
                break
            if d not in keep:
                self._evict(d)
        return self.used_bytes() + need <= self.budget_bytes

    def _enqueue(self, draft: str) -> _Load:
        start = max(self.now, self.queue[-1].done if self.queue else self.now)
        ld = _Load(draft, start, start + self.load_times[draft])
        self.queue.append(ld)
        self.loads += 1
        self.load_busy_s += ld.done - ld.start
        self._note_peak()
        return ld

    # --- the contract -------------------------------------------------------------------
    def prefetch(self, wanted: list[tuple[str, float]]) -> None:
        """Hold the highest value-per-byte set of `wanted` that fits; load it in background."""
        cands = [(d, v, self.sizes[d]) for d, v in wanted if d in self.sizes]
        chosen = fill_by_value(cands, self.budget_bytes)
        keep = set(chosen)
        self.plan = dict(wanted)
        # Drop queued loads that are no longer wanted (the one in flight finishes).
        self.queue = [ld for i, ld in enumerate(self.queue) if i == 0 or ld.draft in keep]
        # Evict the least valuable first.
        order = sorted(self.resident, key=lambda d: self.plan.get(d, 0.0))
        for d in chosen:
            if d in self.resident or any(ld.draft == d for ld in self.queue):
                continue
            if self._make_room(self.sizes[d], keep, order):
                self._enqueue(d)

    def acquire(self, draft: str, wait: bool = True) -> Draft | None:
        """Make `draft` resident now, waiting for it (virtual time moves on by the stall);
        None if it cannot fit."""
        return self.drafts.get(draft) if self.load_now(draft, wait) is not None else None

    def load_now(self, draft: str, wait: bool = True) -> float | None:
        """Make `draft` resident now; return the seconds waited, or None if it cannot fit."""
        if draft in self.resident:
            self.resident[draft] = self.now
            return 0.0
        for ld in self.queue:
            if ld.draft == draft:
                if not wait:
                    return None
                stall = ld.done - self.now
                self.advance(ld.done)
                self.stall_s += stall
                self.resident[draft] = self.now
                return stall
        if not wait:
            return None
        lru = sorted(self.resident, key=self.resident.get)
        if not self._make_room(self.sizes[draft], {draft}, lru):
            return None
        ld = self._enqueue(draft)
        stall = ld.done - self.now
        self.load_busy_s -= ld.done - ld.start  # a foreground load: counted as stall instead
        self.advance(ld.done)
        self.stall_s += stall
        self.resident[draft] = self.now
        return stall

    def touch(self, draft: str) -> None:
        if draft in self.resident:
            self.resident[draft] = self.now

    def status(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(),
            "peak_bytes": self.peak_bytes,
            "resident": sorted(self.resident),
            "loading": [ld.draft for ld in self.queue],
            "loads": self.loads,
            "evictions": self.evictions,
            "stall_s": self.stall_s,
        }
