"""Which targets stay resident when several models share one budget, and when to switch.

The engine worker (memspec.server.worker) holds one Runtime per resident target, each with
its own draft working set, and asks a ResidencyPolicy three things:

- `victims`: the resident models to unload so that a model needing `need` bytes fits. A
  model with requests in flight, or pinned, is never one. None when nothing could make room.
- `hold`: whether requests for a model that is not resident keep waiting while the resident
  ones it would displace (`models`: it and them) still have requests queued.
- `prefetch`: a model worth loading ahead of need now that budget is free.

`DemandResidency` (memspec's) follows the MemSpec decision rule with a model's load in place of
a draft's: keeping a model resident saves `rate × load_s` seconds of loading per second, where
`rate` is its recent arrivals, decayed (DemandEstimate). The least valuable go first, and a
switch waits while the displaced model still has work queued (one load then serves a run of
requests instead of one), but the oldest request of the model waiting for it waits at most
`switch_hold_s`: SWITCH_HOLD_RUNS times the switch's predicted cost (the measured loads of the
model and of those it displaces, which their queued requests will load again), capped by
`max_hold_s` (the setting model_switch_wait_s).
`LruResidency` is Ollama's (its scheduler): first come first served, the least recently used
idle model unloaded; `memspec bench models` runs both on one workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ModelView:
    """What a residency policy reads of one model."""

    name: str
    resident: bool
    bytes: int  # resident: what it holds now (target, KV, drafts); else what a load needs
    in_flight: int  # requests decoding on it
    queued: int  # requests waiting for it
    pinned: bool
    last_used: float  # monotonic seconds
    load_s: float  # its last measured load (an estimate before the first)


class DemandEstimate:
    """Arrivals per model, decayed with a half-life: requests per second, recent ones first."""

    def __init__(self, half_life_s: float = 60.0):
        self.half_life_s = half_life_s
        self._mass: dict[str, tuple[float, float]] = {}  # name -> (decayed count, at)

    def arrive(self, name: str, now: float) -> None:
        self._mass[name] = (self._decayed(name, now) + 1.0, now)

    def rate(self, name: str, now: float) -> float:
        """Arrivals per second: the decayed count over the decay's mean life."""
        return self._decayed(name, now) * math.log(2) / self.half_life_s

    def _decayed(self, name: str, now: float) -> float:
        count, at = self._mass.get(name, (0.0, now))
        return count * 0.5 ** (max(0.0, now - at) / self.half_life_s)


class ResidencyPolicy(Protocol):
    name: str
    first_come_first_served: bool  # a waiting model holds back every request behind it

    def victims(
        self, want: str, need: int, free: int, models: list[ModelView], now: float
    ) -> list[str] | None: ...

    def hold(
        self, want: ModelView, waited_s: float, models: list[ModelView], now: float
    ) -> bool: ...

    def prefetch(self, free: int, models: list[ModelView], now: float) -> str | None: ...


# A switch's oldest waiting request waits at most this many times the switch's predicted cost:
# a busy engine then serves a run of about 8 loads' time between switches, so that loading
# takes about a ninth of its time when two models alternate. (On the stub's model of the
# Poisson 1.0 req/s trace, 4x made 3.3 + 2.6 loads, 8x 2.4 + 2.0, draining each queue
# before switching 2.1 + 2.0, at no cost to the median wait: tests/scheduler.)
SWITCH_HOLD_RUNS = 8.0


def switch_hold_s(want: ModelView, models: list[ModelView], max_hold_s: float) -> float:
    """How long `want`'s oldest request may wait for the resident models it would displace
    (those of `models` with requests queued) to serve their queued runs first."""
    displaced = [m for m in models if m.resident and m.name != want.name and m.queued > 0]
    cost = want.load_s + sum(m.load_s for m in displaced)
    return min(max_hold_s, SWITCH_HOLD_RUNS * cost)


def _evictable(m: ModelView, want: str) -> bool:
    return m.resident and m.name != want and not m.pinned and m.in_flight == 0


def _take(order: list[ModelView], need: int, free: int) -> list[str] | None:
    """The first models of `order` whose bytes make `free` reach `need`; None if all cannot."""
    out: list[str] = []
    for m in order:
        if free >= need:
            break
        out.append(m.name)
        free += m.bytes
    return out if free >= need else None


class DemandResidency:
    name = "memspec"
    first_come_first_served = False

    def __init__(self, demand: DemandEstimate, max_hold_s: float = 30.0):
        self.demand = demand
        self.max_hold_s = max_hold_s

    def value(self, m: ModelView, now: float) -> float:
        """Seconds of loading saved per second by keeping `m` resident."""
        return self.demand.rate(m.name, now) * m.load_s

    def victims(
        self, want: str, need: int, free: int, models: list[ModelView], now: float
    ) -> list[str] | None:
        if free >= need:
            return []
        # Idle models first, then those with requests queued; least valuable first in each.
        evictable = (m for m in models if _evictable(m, want))
        order = sorted(evictable, key=lambda m: (m.queued > 0, self.value(m, now), m.last_used))
        return _take(order, need, free)

    def hold(self, want: ModelView, waited_s: float, models: list[ModelView], now: float) -> bool:
        """Wait while a resident model it would displace still has requests queued and the
        switch has not waited switch_hold_s: its run goes on, and the switch then serves
        `want`'s run."""
        if not any(m.resident and m.name != want.name and m.queued > 0 for m in models):
            return False
        return waited_s < switch_hold_s(want, models, self.max_hold_s)

    def prefetch(self, free: int, models: list[ModelView], now: float) -> str | None:
        """The absent model with the most value that fits the free budget, if it has demand."""
        fits = [m for m in models if not m.resident and m.bytes <= free]
        best = max(fits, key=lambda m: self.value(m, now), default=None)
        return best.name if best is not None and self.demand.rate(best.name, now) > 0 else None


class LruResidency:
    """Ollama's scheduler: requests in arrival order (one for a model that must load holds
    back the rest), the least recently used idle model unloaded, nothing loaded ahead."""

    name = "lru"
    first_come_first_served = True

    def victims(
        self, want: str, need: int, free: int, models: list[ModelView], now: float
    ) -> list[str] | None:
        if free >= need:
            return []
        order = sorted((m for m in models if _evictable(m, want)), key=lambda m: m.last_used)
        return _take(order, need, free)

    def hold(self, want: ModelView, waited_s: float, models: list[ModelView], now: float) -> bool:
        return False

    def prefetch(self, free: int, models: list[ModelView], now: float) -> str | None:
        return None


RESIDENCY_POLICIES = ("memspec", "lru")


def residency_policy(name: str, demand: DemandEstimate, max_hold_s: float) -> ResidencyPolicy:
    if name == "lru":
        return LruResidency()
    if name == "memspec":
        return DemandResidency(demand, max_hold_s)
    raise ValueError(f"unknown residency policy {name!r} (known: {', '.join(RESIDENCY_POLICIES)})")
