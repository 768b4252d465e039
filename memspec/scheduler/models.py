"""Which target models are resident and when to switch: one owner, as Ollama's server/sched.go.

    models = ModelScheduler(pool, loader, settings, queued, in_flight)
    plan = models.plan(waiting, in_flight, now)   # engine thread, under the worker's lock
    error = models.load_for_waiting(plan.load, stalled)  # between rounds
    models.housekeep(busy, idle, now)              # keep_alive expiry, then prefetch

The engine worker (memspec.server.worker) keeps the queue, admission into slots and the
engine thread; it asks this object which waiting requests may run now, which model to load
next, and when. This object decides and keeps each model's named state; the pool (the
resident runtimes and their budget shares: memspec.targets.Targets) does the loading, and
`loader` wraps one load with what the engine thread needs (a heartbeat, the abandon check).

A model is in one state at a time:

    absent    -> loading (a load starts) or loaded (adopted: the daemon's first target)
    loading   -> loaded; failed (its waiting requests failed; the next one tries again);
                 absent (abandoned: every client that waited for it left)
    loaded   <-> expiring (idle after a request with a keep_alive: unloaded once it runs out;
                 a request admitted makes it loaded again)
    loaded, expiring -> unloading (evict, expire, unload) -> absent

Switching (the ResidencyPolicy's rule, memspec.scheduler.residency): a request for a model that
is not resident waits while the resident one it would displace still has requests queued, so
that one load serves a run, but its oldest request waits at most a hold sized by the switch's
predicted cost (the measured loads of both models), capped by `model_switch_wait_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from memspec.errors import (
    BudgetExceeded,
    LoadAbandoned,
    MemSpecError,
    ModelDoesNotFit,
    ModelLoadError,
)
from memspec.scheduler.residency import (
    DemandEstimate,
    ModelView,
    ResidencyPolicy,
    residency_policy,
)
from memspec.units import format_size

if TYPE_CHECKING:
    from memspec.config import Settings

log = logging.getLogger("memspec.server")

# A model is loaded ahead of need only once the engine has been idle this long: a gap between
# one client's answer and its next request is milliseconds, and a load into it was evicted
# unused by the next request for the other model (the thrash case).
PREFETCH_SETTLE_S = 1.0


class ModelState(str, Enum):
    ABSENT = "absent"
    LOADING = "loading"
    LOADED = "loaded"  # resident, in use or kept with no expiry
    EXPIRING = "expiring"  # resident and idle, its keep_alive running
    UNLOADING = "unloading"
    FAILED = "failed"  # its last load failed; not resident


# The moves the diagram above allows; any other is a bug, logged (the engine goes on).
TRANSITIONS: dict[ModelState, set[ModelState]] = {
    ModelState.ABSENT: {ModelState.LOADING, ModelState.LOADED},  # loaded: adopted (start)
    ModelState.LOADING: {ModelState.LOADED, ModelState.FAILED, ModelState.ABSENT},
    ModelState.LOADED: {ModelState.EXPIRING, ModelState.UNLOADING},
    ModelState.EXPIRING: {ModelState.LOADED, ModelState.UNLOADING},
    ModelState.UNLOADING: {ModelState.ABSENT},
    ModelState.FAILED: {ModelState.LOADING, ModelState.LOADED},
}
RESIDENT = (ModelState.LOADED, ModelState.EXPIRING)


class Waiting(Protocol):
    """What the scheduler reads of a waiting request (the worker's GenerateJob)."""

    model: str
    enqueued_at: float  # monotonic


J = TypeVar("J", bound=Waiting)


class ModelPool(Protocol):
    """The resident models and their budget shares (memspec.targets.Targets)."""

    stats: Mapping[str, Any]

    def stat(self, name: str) -> Any: ...  # its ModelStats, made on first use

    @property
    def resident(self) -> list[str]: ...

    def free_slots(self, name: str) -> int: ...

    def views(
        self, settings: Settings, in_flight: dict[str, int], queued: dict[str, int]
    ) -> list[ModelView]: ...

    def unservable(self, name: str) -> MemSpecError: ...

    def free_after_handback(self) -> int: ...

    def free_budget(self) -> int: ...

    def unload(self, name: str, why: str) -> None: ...

    def admitted(self, name: str) -> None: ...

    def embed_share(self, name: str) -> Any: ...

    def status(self, now_mono: float, now_wall: float) -> list[dict[str, Any]]: ...


# loader(name, abandon, ahead): load `name` into the free budget (its victims already gone);
# stop part way with LoadAbandoned once abandon() is true. `ahead`: nothing waits for it (a
# prefetch: load it whole); else requests wait (the target first, its drafts join later).
Loader = Callable[[str, Callable[[], bool], bool], None]


@dataclass
class Plan(Generic[J]):
    admit: list[J] = field(default_factory=list)  # their model resident with a free slot
    load: str | None = None  # the model to load now
    failed: dict[str, MemSpecError] = field(default_factory=dict)  # model -> why its requests fail


class ModelScheduler:
    def __init__(
        self,
        pool: ModelPool,
        loader: Loader,
        settings: Callable[[], Settings],
        queued: Callable[[], Counter[str]],
        in_flight: Callable[[], Counter[str]],
        on_change: Callable[[str, str], None] | None = None,
        metrics: Any = None,
        clock: Callable[[], float] | None = None,
    ):
        """`queued()`: requests waiting per model, their clients still there; `in_flight()`:
        those admitted or decoding; `on_change(model, what)` hears of each load, unload
        ("evict", "expire", "unload"), wasted and abandoned load; `metrics`
        (memspec.server.metrics.Metrics) gets the load times and the per-model rows."""
        self.pool = pool
        self._loader = loader
        self._settings = settings
        self._queued = queued
        self._in_flight = in_flight
        self._on_change = on_change
        self.metrics = metrics
        self.clock = clock or time.monotonic
        self.demand = DemandEstimate()
        self.states: dict[str, ModelState] = {}
        self.draining: set[str] = set()  # resident models admitting nothing (a switch waits)
        self._idle_since = self.clock()  # since when nothing waits or runs (prefetch)

    @property
    def settings(self) -> Settings:
        return self._settings()

    @property
    def policy(self) -> ResidencyPolicy:
        s = self.settings
        return residency_policy(s.residency, self.demand, s.model_switch_wait_s)

    # --- states ---------------------------------------------------------------------------
    def state(self, name: str) -> ModelState:
        return self.states.get(name, ModelState.ABSENT)

    def _move(self, name: str, new: ModelState) -> None:
        old = self.state(name)
        if old is new:
            return
        if new not in TRANSITIONS[old]:  # a bug: said, and the state follows the facts
            log.error("model %s: state %s -> %s is not a transition", name, old.value, new.value)
        self.states[name] = new

    def changed(self, name: str, what: str) -> None:
        """The pool's news (Targets on_change): a model loaded, left, or was loaded for nothing."""
        if what == "load":
            self._move(name, ModelState.LOADED)
        elif what in ("evict", "expire", "unload"):
            if self.state(name) in RESIDENT:
                self._move(name, ModelState.UNLOADING)
            self._move(name, ModelState.ABSENT)
        if self._on_change is not None:
            self._on_change(name, what)

    # --- requests -------------------------------------------------------------------------
    def arrive(self, name: str, now: float) -> None:
        """A request for `name` was queued (predicted demand)."""
        self.demand.arrive(name, now)

    def admitted(self, name: str) -> None:
        """A request for the resident `name` took a slot: in use, it does not expire (as
        Ollama stops a runner's expiry timer while its refCount is above 0)."""
        self.pool.admitted(name)
        if self.state(name) is ModelState.EXPIRING:
            self._move(name, ModelState.LOADED)

    def finished(self, name: str, keep_alive_s: float | None, now: float) -> None:
        """A request for `name` ended: it stays for its keep_alive from now (`keep_alive_s`:
        the request's; None: the setting's; negative: no expiry), counted once it is idle."""
        expiry = self.keep_alive(keep_alive_s)
        st = self.pool.stat(name)
        st.last_used = now
        st.expires_at = None if expiry is None else now + expiry
        if name in self.pool.resident:
            idle = self._in_flight()[name] == 0
            self._move(
                name, ModelState.EXPIRING if expiry is not None and idle else ModelState.LOADED
            )

    def keep_alive(self, asked: float | None) -> float | None:
        """A request's keep_alive (None: not given) as an expiry delay (None: no expiry)."""
        if asked is None:
            return self.settings.keep_alive_s
        return None if asked < 0 else asked

    # --- which requests run, which model loads --------------------------------------------
    def plan(self, waiting: Sequence[J], in_flight: Mapping[str, int], now: float) -> Plan[J]:
        """Under the worker's lock: the waiting requests (oldest first) to admit now (their
        model resident, a slot free, the model not draining), then the model to load, if one
        is due, and the models whose requests must fail. Admission goes first, so a model just
        loaded takes its waiting run before any switch can unload it (the admitted count as
        in flight)."""
        fcfs = self.policy.first_come_first_served
        # First come first served: those ahead of the request that must load run in their
        # turn, whatever drains.
        admit, keep = self._admissible(waiting, set() if fcfs else self.draining, fcfs)
        plan: Plan[J] = Plan(admit)
        plan.load, self.draining = self._switch(keep, in_flight, admit, plan.failed, now)
        stats = self.pool.stats
        late = {m for m in self.draining if m in stats and stats[m].served > 0}
        if not fcfs and any(j.model in late for j in admit):
            # The switch's wait is over now: the models it displaces take no more, not one
            # more each (one just loaded, which has served nothing yet, keeps its first).
            back = [j for j in admit if j.model in late]
            admit = [j for j in admit if j.model not in late]
            failed: dict[str, MemSpecError] = {}
            load, draining = self._switch([*keep, *back], in_flight, admit, failed, now)
            if load is not None or draining:  # still due without them: they wait
                plan, self.draining = Plan(admit, load, failed), draining
        return plan

    def _admissible(
        self, waiting: Sequence[J], draining: set[str], fcfs: bool
    ) -> tuple[list[J], list[J]]:
        """The waiting requests split into those that take a free slot now and the rest."""
        resident = set(self.pool.resident)
        free = {name: self.pool.free_slots(name) for name in resident}
        admit: list[J] = []
        keep: list[J] = []
        blocked = False  # first come first served: a request that must load holds the rest
        for job in waiting:
            if not blocked and job.model not in draining and free.get(job.model, 0) > 0:
                admit.append(job)
                free[job.model] -= 1
            else:
                keep.append(job)
                blocked = blocked or (fcfs and job.model not in resident)
        return admit, keep

    def _switch(
        self,
        keep: Sequence[Waiting],
        in_flight: Mapping[str, int],
        admitted: Sequence[Waiting],
        failed: dict[str, MemSpecError],
        now: float,
    ) -> tuple[str | None, set[str]]:
        """For the longest-waiting model that is not resident: load it now (None if not), or
        stop admitting to the busy models it must displace (the draining set)."""
        resident = set(self.pool.resident)
        absent: dict[str, float] = {}  # model -> when its oldest request arrived
        for job in keep:
            if job.model not in resident:
                absent[job.model] = min(job.enqueued_at, absent.get(job.model, job.enqueued_at))
        if not absent:
            return None, set()
        name = min(absent, key=lambda n: absent[n])
        busy = Counter(in_flight)
        busy.update(j.model for j in admitted)  # in flight from here on: never a victim
        queued = Counter(j.model for j in keep)
        views = self.pool.views(self.settings, busy, queued)
        want = next((v for v in views if v.name == name), None)
        if want is None:  # gone from the models dir since it was asked for, or gone bad
            failed[name] = self.pool.unservable(name)
            return None, set()
        policy = self.policy
        free = self.pool.free_after_handback()
        waited = now - absent[name]

        def hold(victims: list[str]) -> bool:
            """The models `want` displaces serve their queued run first, within its bound."""
            displaced = [v for v in views if v.name in victims]
            return bool(displaced) and policy.hold(want, waited, [want, *displaced], now)

        victims = policy.victims(name, want.bytes, free, views, now)
        if victims is not None:  # room now, once idle models are unloaded
            return (None, set()) if hold(victims) else (name, set())
        idle = [dataclasses.replace(v, in_flight=0) for v in views]
        victims = policy.victims(name, want.bytes, free, idle, now)
        if victims is None:  # pinned models, or too big for the budget: it can never fit now
            pinned = [v.name for v in views if v.resident and v.pinned]
            failed[name] = ModelDoesNotFit(
                f"model {name!r} needs {format_size(want.bytes)} and cannot fit the budget "
                f"of {format_size(self.settings.budget_bytes)}"
                + (f" beside the pinned {', '.join(pinned)}" if pinned else "")
                + "; raise the budget or lower n_ctx (see `memspec plan`)",
                param="model",
            )
            return None, set()
        if hold(victims):
            return None, set()
        return None, {v for v in victims if v in resident}  # they drain, then go

    # --- loads and unloads (engine thread) --------------------------------------------------
    def load_for_waiting(self, name: str, stalled: int) -> MemSpecError | None:
        """Load `name` for the requests waiting for it, unloading the idle models the policy
        picks; `stalled`: the requests that wait while it loads (metrics). The error its
        waiting requests fail with when the load fails; None when it loaded, or stopped
        because every client that waited for it left."""
        t0 = self.clock()
        try:
            self.make_resident(name, abandon=lambda: name not in self._live_queued())
        except LoadAbandoned as e:  # nothing loaded is kept or thrown away
            log.info("loading model %s stopped after %.1f s: %s", name, self.clock() - t0,
                     e.message)  # fmt: skip
            return None
        except Exception as e:  # noqa: BLE001 - its requests fail; the others go on
            error = e if isinstance(e, MemSpecError) else ModelLoadError(str(e), param="model")
            log.error("loading model %s failed: %s", name, getattr(error, "message", error))
            return error
        if self.metrics is not None:
            self.metrics.observe_model_load(name, self.clock() - t0, stalled)
        return None

    def make_resident(self, name: str, abandon: Callable[[], bool] | None = None) -> None:
        """Load `name` after unloading the idle models the policy picks; raises why not
        (unknown, unusable, does not fit, the load's own error, LoadAbandoned)."""
        queued = self._queued()
        queued[name] = max(1, queued[name])
        views = self.pool.views(self.settings, self._in_flight(), queued)
        want = next((v for v in views if v.name == name), None)
        if want is None:
            raise self.pool.unservable(name)
        free = self.pool.free_after_handback()
        victims = self.policy.victims(name, want.bytes, free, views, self.clock())
        for victim in victims or []:
            self.pool.unload(victim, "evict")
        self._load(name, abandon or (lambda: False), ahead=False)

    def _load(self, name: str, abandon: Callable[[], bool], ahead: bool) -> None:
        self._move(name, ModelState.LOADING)
        try:
            self._loader(name, abandon, ahead)
        except LoadAbandoned:
            self._move(name, ModelState.ABSENT)
            self.changed(name, "abandoned")
            raise
        except BaseException:
            self._move(name, ModelState.FAILED)
            raise
        self._move(name, ModelState.LOADED)  # the pool said so already; a stub may not

    def _live_queued(self) -> set[str]:
        return {m for m, n in self._queued().items() if n > 0}

    def unload(self, name: str, why: str = "unload") -> bool:
        """Unload `name` now (Ollama's keep_alive 0, memspec-ctl); False if not resident.
        The caller has let its in-flight requests finish (a control job)."""
        if name not in self.pool.resident:
            return False
        self.pool.unload(name, why)
        return True

    def load(self, name: str, keep_alive_s: float | None = None) -> None:
        """Make `name` resident (Ollama's empty request); it stays for `keep_alive_s` (None:
        the setting; negative: no expiry)."""
        if name not in self.pool.resident:
            self.make_resident(name)
        self.finished(name, keep_alive_s, self.clock())

    def load_embedder(self, name: str) -> None:
        """The embedding context of the resident model `name`, set up as a model is loaded.
        The other resident models hand back the share they do not use and `name` gets the free
        budget; if the context still cannot fit, idle models are unloaded in the residency
        policy's order, one at a time, as Ollama unloads an idle model to make room.
        BudgetExceeded when only pinned or busy models are in the way."""
        while name in self.pool.resident:
            try:
                self.pool.embed_share(name)
                return
            except BudgetExceeded:
                views = self.pool.views(self.settings, self._in_flight(), self._queued())
                free = self.pool.free_after_handback()
                victims = self.policy.victims(name, free + 1, free, views, self.clock())
                if not victims:
                    raise
                self.pool.unload(victims[0], "evict")

    # --- idle: keep_alive expiry, prefetch --------------------------------------------------
    def housekeep(self, busy: set[str], idle: bool, now: float) -> None:
        """Unload the models whose keep_alive ran out (none in `busy`: requests in flight or
        waiting); once the engine has been `idle` for PREFETCH_SETTLE_S, load ahead the model
        the policy expects next, among those the budget pushed out (never one a client
        unloaded or let expire)."""
        expired = [
            n
            for n in self.pool.resident
            if n not in busy and (e := self.pool.stat(n).expires_at) is not None and e <= now
        ]
        for name in expired:
            self.pool.unload(name, "expire")
        if expired or not idle:
            self._idle_since = now
            return
        if now - self._idle_since < PREFETCH_SETTLE_S:
            return
        stats = self.pool.stats
        pushed_out = [n for n, st in stats.items() if st.last_evicted_why == "evict"]
        if not pushed_out:
            return
        views = self.pool.views(self.settings, {}, Counter({n: 0 for n in pushed_out}))
        ahead = self.policy.prefetch(self.pool.free_budget(), views, now)
        if ahead is None or ahead in self.pool.resident:
            return
        log.info("loading model %s ahead of need (predicted demand)", ahead)
        try:  # into free budget only: a load ahead of need never unloads another model
            # ...and it stops if a request for another model comes meanwhile: that one needs
            # the budget, and this load would be evicted before it served anything.
            self._load(ahead, lambda: bool(self._live_queued() - {ahead}), ahead=True)
        except LoadAbandoned as e:
            log.info("loading %s ahead of need stopped: %s", ahead, e.message)
        except MemSpecError as e:
            log.info("not loading %s ahead of need: %s", ahead, e.message)

    # --- status ---------------------------------------------------------------------------
    def status(self, now_mono: float, now_wall: float) -> list[dict[str, Any]]:
        """Every servable model: its state, bytes, share, expiry, loads, evictions."""
        rows = self.pool.status(now_mono, now_wall)
        for row in rows:
            row["state"] = self.state(row["name"]).value
        return rows

    def observe(self) -> None:
        """The per-model rows into the metrics (after each change of residency)."""
        if self.metrics is not None:
            self.metrics.observe_models(self.status(time.monotonic(), time.time()))
