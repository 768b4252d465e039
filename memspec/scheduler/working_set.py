"""The working set: which drafts are resident, under a byte budget that is never exceeded.

One background thread loads and evicts; the engine keeps decoding with whatever is resident
(or with no draft) meanwhile, and only waits when it asks to (`acquire(id, wait=True)`, a
reactive load: the wait is counted as stall). Like Ollama's server/sched.go, every draft is in
one explicit state, and memory is checked before a load:

    absent ──load──▶ loading ──ok──▶ resident ──evict──▶ evicting ──closed──▶ absent
                        └──error──▶ failed (reason kept; retried only by an explicit load)

The budget covers everything: `reserved_bytes` (the target, its KV cache and buffers: charged
first) plus the modelled footprint of every draft that is loading, resident or evicting (its
memory is only free once it is closed). A load starts only when its bytes fit; otherwise the
lowest value-per-byte unpinned drafts are evicted first (not the least recently used: value
comes from the policy's `prefetch`; LRU only breaks ties), or the load is refused with
BudgetExceeded when pinned drafts block it.

Draft objects are not reference counted by Python alone: closing a llama.cpp draft while the
engine is inside its propose() would free memory under it. So every draft handed out by
`get`, `acquire` or `lease_resident` is *leased* to the calling thread, and an
evicted draft is closed only once no thread holds it. Leases end in one place: the scope that
took them, `with ws.leased():` (the engine's round, Runtime.decode_round), ends them however
it ends. A call that may wait on the loader (acquire, load, evict, a budget change, close)
first lets go of the calling thread's own leases, which the loader might otherwise wait on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import psutil

from memspec.compat import StrEnum, name_os_thread
from memspec.engine.types import Draft
from memspec.errors import BudgetExceeded, InvalidRequest, ModelLoadError, UnknownDraft
from memspec.memory.fill import fill_by_value
from memspec.units import format_size

log = logging.getLogger(__name__)


class DraftState(StrEnum):
    ABSENT = "absent"
    LOADING = "loading"
    RESIDENT = "resident"
    EVICTING = "evicting"
    FAILED = "failed"


# States whose bytes count against the budget.
_HOLDS_MEMORY = (DraftState.LOADING, DraftState.RESIDENT, DraftState.EVICTING)


@runtime_checkable
class DraftSource(Protocol):
    """Where drafts come from: ids, kinds, modelled bytes, and a real load."""

    def draft_ids(self) -> list[str]: ...

    def draft_kind(self, draft_id: str) -> str: ...

    def draft_bytes(self, draft_id: str) -> int:
        """Modelled resident bytes; ModelLoadError if the draft's file is missing/unreadable."""
        ...

    def load_draft(self, draft_id: str) -> Draft:
        """A real load; ModelLoadError (nothing left allocated) if it fails."""
        ...

    def shares_target_kv(self, draft_id: str) -> bool:
        """Whether the draft will copy the target's KV cache rather than catch up, before it
        is loaded (a loaded draft says so itself: ModelDraft.kv_donor)."""
        ...


@dataclass
class FactorySource:
    """A DraftSource from a plain factory and known sizes (tests, tools, the simulator)."""

    factory: Callable[[str], Draft]
    sizes: dict[str, int]
    kinds: dict[str, str] | None = None

    def draft_ids(self) -> list[str]:
        return list(self.sizes)

    def draft_kind(self, draft_id: str) -> str:
        return (self.kinds or {}).get(draft_id, "model")

    def draft_bytes(self, draft_id: str) -> int:
        return self.sizes[draft_id]

    def load_draft(self, draft_id: str) -> Draft:
        return self.factory(draft_id)

    def shares_target_kv(self, draft_id: str) -> bool:
        return False  # not known before the factory has built it


@dataclass
class _Slot:
    id: str
    kind: str
    state: DraftState = DraftState.ABSENT
    draft: Draft | None = None
    bytes: int | None = None  # modelled; None until first needed
    pinned: bool = False
    holds: int = 0  # requests using it explicitly: not chosen as a victim
    uses: int = 0  # leases: it is not closed while > 0
    value: float = 0.0  # from the last prefetch (or 0)
    last_used: float = 0.0
    error: str | None = None
    refused: str | None = None  # why the last load request could not fit
    load_s: float | None = None
    measured_bytes: int | None = None  # RSS delta around the last load (noisy: other threads)
    loaded_seq: int = 0
    evicted: bool = False  # evicted on purpose: not reloaded automatically


class WorkingSet:
    """Resident drafts under a byte budget; loads and evicts in one background thread.

    `source`: where drafts come from (ids, kinds, modelled bytes, loads).
    `budget_bytes`: the whole budget, `reserved_bytes` (target + KV + buffers) included.
    `on_loaded(draft)`: runs on the loader thread after a load, before the draft is resident
    (e.g. measure its cost); if it raises, the draft is closed and marked failed.
    `autoload_free`: drafts that take no memory (prompt lookup) are always made resident,
    unless explicitly evicted; policies may treat them as always available."""

    def __init__(
        self,
        source: DraftSource,
        budget_bytes: int,
        reserved_bytes: int = 0,
        *,
        on_loaded: Callable[[Draft], None] | None = None,
        autoload_free: bool = True,
    ):
        self.source = source
        self.reserved_bytes = int(reserved_bytes)
        if self.reserved_bytes > budget_bytes:
            raise BudgetExceeded(
                f"budget {format_size(budget_bytes)} is below what the target alone needs "
                f"({format_size(self.reserved_bytes)})",
                param="budget",
            )
        self._budget = int(budget_bytes)
        self.on_loaded = on_loaded
        self._cond = threading.Condition(threading.Lock())
        self._slots: dict[str, _Slot] = {
            i: _Slot(i, self.source.draft_kind(i)) for i in self.source.draft_ids()
        }
        # ("load" | "fill" | "evict", id); "fill" loads only into free room, never evicting.
        self._commands: deque[tuple[str, str]] = deque()
        self._plan: list[str] = []  # prefetch: ids to hold, in priority order
        self._sticky: set[str] = set()  # reactively acquired since the last prefetch
        self._tls = threading.local()
        self._seq = 0
        self._idle = False
        self._changed = False  # victims were marked: re-plan at once, do not sleep
        self._closed = False
        self.autoload_free = autoload_free
        # Counters (read freely; written under the lock).
        self.loads = self.evictions = self.load_failures = self.refusals = 0
        self.stall_s = 0.0
        self.peak_bytes = self.reserved_bytes
        for slot in self._slots.values():
            self._bytes(slot)  # read every footprint once (a missing file is retried later)
        self._worker = threading.Thread(target=self._run, name="memspec-working-set", daemon=True)
        self._worker.start()

    # --- budget -------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._budget

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        """Change the budget live. Shrinking evicts (lowest value per byte first) and returns
        once usage is under the new budget; BudgetExceeded if pinned drafts do not fit."""
        value = int(value)
        self.release_leases()
        with self._cond:
            floor = self.reserved_bytes + self._pinned_bytes()
            if value < floor:
                raise BudgetExceeded(
                    f"budget {format_size(value)} is below the target and pinned drafts "
                    f"({format_size(floor)})",
                    param="budget",
                )
            self._budget = value
            self._kick()
            while self._used() > self._budget and not self._closed:
                self._cond.wait(0.5)

    def used_bytes(self) -> int:
        """Modelled bytes in use: reserved + every draft loading, resident or evicting."""
        with self._cond:
            return self._used()

    def refresh_bytes(self) -> None:
        """Read every draft's modelled bytes again: a draft's weights cost nothing while a
        served model holds them (ManifestSource.footprint), so they change when one loads or
        leaves. The caller then fits the budget to the new figure (memspec.targets)."""
        with self._cond:
            for s in self._slots.values():
                s.bytes = None
                self._bytes(s)
            self.peak_bytes = max(self.peak_bytes, self._used())
            self._kick()

    def reserve(self, nbytes: int, what: str) -> None:
        """Charge `nbytes` more beside the target (`what` is for the error: e.g. the embedding
        context), evicting unpinned drafts until they fit; returns once they do, before the
        caller allocates. BudgetExceeded if the target and pinned drafts leave too little.
        A negative `nbytes` gives bytes back."""
        self.release_leases()
        with self._cond:
            if nbytes > 0:
                free = self._budget - self.reserved_bytes - self._pinned_bytes()
                if nbytes > free:
                    raise BudgetExceeded(
                        f"{what} needs {format_size(nbytes)}; the budget "
                        f"{format_size(self._budget)} leaves {format_size(max(free, 0))} beside "
                        "the target and the pinned drafts",
                        param="budget",
                    )
            self.reserved_bytes += int(nbytes)
            self._kick()
            while self._used() > self._budget and not self._closed:
                self._cond.wait(0.5)
            self.peak_bytes = max(self.peak_bytes, self._used())  # allocated from here on

    # --- residency ----------------------------------------------------------------------
    def resident_ids(self) -> set[str]:
        with self._cond:
            return {s.id for s in self._slots.values() if s.state == DraftState.RESIDENT}

    def get(self, draft_id: str) -> Draft | None:
        """The draft if resident now (leased to this thread), else None. Never loads."""
        with self._cond:
            s = self._slot(draft_id)
            return self._lease(s) if s.state == DraftState.RESIDENT else None

    def lease_resident(self, ids: Iterable[str] | None = None) -> list[Draft]:
        """Every resident draft (or those of `ids`), in load order, leased to this thread."""
        with self._cond:
            slots = self._slots.values() if ids is None else [self._slot(i) for i in ids]
            res = sorted(
                (s for s in slots if s.state == DraftState.RESIDENT), key=lambda s: s.loaded_seq
            )
            return [self._lease(s) for s in res]

    @contextlib.contextmanager
    def leased(self) -> Iterator[None]:
        """A scope whose drafts (get, acquire, lease_resident) are leased to this thread until
        it ends, normally or by an exception: one round of the engine."""
        try:
            yield
        finally:
            self.release_leases()

    def release_leases(self) -> None:
        """Release every draft this thread holds (the end of `leased`, or a wait). The
        loader is woken only if a draft it waits to close is free now: leases hold nothing
        else up, and a wake-up every round (the loader re-planning, a thread switch on the
        cores the model decodes on) cost each speculative round for nothing."""
        leases: dict[str, int] = getattr(self._tls, "leases", {})
        if not leases:
            return
        with self._cond:
            freed = False
            for draft_id, n in leases.items():
                s = self._slots[draft_id]
                s.uses -= n
                freed = freed or (s.uses == 0 and s.state == DraftState.EVICTING)
            leases.clear()
            if freed:
                self._kick()

    @contextlib.contextmanager
    def holding(self, *ids: str) -> Iterator[None]:
        """Protect drafts from being chosen as eviction victims (a request that named them)."""
        with self._cond:
            slots = [self._slot(i) for i in ids]
            for s in slots:
                s.holds += 1
        try:
            yield
        finally:
            with self._cond:
                for s in slots:
                    s.holds -= 1
                self._kick()

    def acquire(self, draft_id: str, wait: bool = True) -> Draft | None:
        """Make a draft resident: a reactive load, evicting lower-value drafts if needed.
        wait=True blocks until it is resident (the time counts as stall) and returns it;
        wait=False returns it only if already resident, else schedules the load and returns
        None. None also when its load failed (see status()). BudgetExceeded when it cannot
        fit beside the pinned (and in-use) drafts."""
        with self._cond:
            s = self._slot(draft_id)
            if s.state == DraftState.RESIDENT:
                s.last_used = time.monotonic()
                return self._lease(s)
            if s.state == DraftState.FAILED:
                return None
            s.evicted = False
            self._sticky.add(draft_id)
            self._request(s)
            if not wait:
                return None
        self.release_leases()  # a load may need to close drafts this thread holds
        t0 = time.perf_counter()
        with self._cond:
            try:
                self._wait_settled(s)
            finally:
                dt = time.perf_counter() - t0
                self.stall_s += dt
                self._tls.stall_s = getattr(self._tls, "stall_s", 0.0) + dt
            if s.state != DraftState.RESIDENT:
                return None
            s.last_used = time.monotonic()
            return self._lease(s)

    def thread_stall_s(self) -> float:
        """Seconds this thread has waited in acquire() (per request: take a difference)."""
        return getattr(self._tls, "stall_s", 0.0)

    def load(self, draft_id: str, evict: bool = True) -> Draft:
        """Explicit load (admin, start-up): retries a failed draft; raises on failure.
        evict=False loads only into free room (start-up preloading), never evicting."""
        with self._cond:
            s = self._slot(draft_id)
            if s.state == DraftState.FAILED:
                s.state, s.error, s.bytes = DraftState.ABSENT, None, None
            s.evicted = False
        self.release_leases()
        op = "load" if evict else "fill"
        with self._cond:
            self._request(s, op)
            self._wait_settled(s, op)
            if s.state == DraftState.FAILED:
                raise ModelLoadError(s.error or f"draft {draft_id!r} failed to load", param="draft")
            if s.state != DraftState.RESIDENT:
                raise ModelLoadError("the working set is closed", param="draft")
            return s.draft  # type: ignore[return-value]

    def prefetch(self, wanted: list[tuple[str, float]]) -> None:
        """Hold the highest value-per-byte set of `wanted` that fits (pinned always kept):
        (id, value) pairs in priority order; drafts not named get value 0 and are evicted
        first when room is needed. Loads happen in the background; returns at once."""
        with self._cond:
            values = {i: float(v) for i, v in wanted if i in self._slots}
            for s in self._slots.values():
                s.value = values.get(s.id, 0.0)
            room = self._budget - self.reserved_bytes - self._pinned_bytes()
            cands = []
            for i, v in values.items():
                s = self._slots[i]
                if v <= 0 or s.state == DraftState.FAILED or s.pinned:
                    continue
                b = self._bytes(s)
                if b is not None:
                    cands.append((i, v, b))
            chosen = set(fill_by_value(cands, room))
            # Load in the caller's priority order.
            self._plan = [i for i, _ in wanted if i in chosen]
            self._sticky.clear()
            self._kick()

    def pin(self, draft_id: str) -> Draft:
        """Load (if needed) and keep resident until unpinned: never a victim."""
        draft = self.load(draft_id)
        with self._cond:
            self._slot(draft_id).pinned = True
        return draft

    def unpin(self, draft_id: str) -> None:
        with self._cond:
            self._slot(draft_id).pinned = False
            self._kick()

    def evict(self, draft_id: str) -> None:
        """Evict now (waits until closed); InvalidRequest if pinned. Leaves the plan too."""
        self.release_leases()
        with self._cond:
            s = self._slot(draft_id)
            if s.pinned:
                raise InvalidRequest(f"draft {draft_id!r} is pinned; unpin it first", param="draft")
            self._plan = [i for i in self._plan if i != draft_id]
            self._sticky.discard(draft_id)
            s.evicted = True
            self._commands = deque(c for c in self._commands if c[1] != draft_id)
            self._commands.append(("evict", draft_id))
            self._kick()
            while not self._closed and (
                self._pending(draft_id) or s.state in (DraftState.LOADING, DraftState.EVICTING)
            ):
                self._cond.wait(0.5)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the loader has nothing left to do (tests, start-up). True if idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and not self._idle:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return True

    def state(self, draft_id: str) -> DraftState:
        with self._cond:
            return self._slot(draft_id).state

    def status(self) -> list[dict[str, Any]]:
        """One row per known draft (ids in source order)."""
        with self._cond:
            return [
                {
                    "id": s.id,
                    "kind": s.kind,
                    "bytes": self._bytes(s) or 0,
                    "state": s.state.value,
                    "resident": s.state == DraftState.RESIDENT,
                    "pinned": s.pinned,
                    "error": s.error,
                    "value": s.value,
                    "in_use": s.uses > 0 or s.holds > 0,
                    "load_s": None if s.load_s is None else round(s.load_s, 4),
                    "measured_bytes": s.measured_bytes,
                    # A self-draft that copies the target's KV cache instead of catching up.
                    "shares_target_kv": self._shares_target_kv(s),
                }
                for s in self._slots.values()
            ]

    def _shares_target_kv(self, s: _Slot) -> bool:
        if s.draft is not None:  # loaded: what it does (a refused copy drops the donor)
            return getattr(s.draft, "kv_donor", None) is not None
        return self.source.shares_target_kv(s.id)

    def summary(self) -> dict[str, Any]:
        """Budget and counters (what status/metrics report beside the rows)."""
        with self._cond:
            return {
                "budget_bytes": self._budget,
                "reserved_bytes": self.reserved_bytes,
                "used_bytes": self._used(),
                "peak_bytes": self.peak_bytes,
                "loads": self.loads,
                "evictions": self.evictions,
                "load_failures": self.load_failures,
                "refusals": self.refusals,
                "stall_s": round(self.stall_s, 4),
                "resident": sorted(
                    s.id for s in self._slots.values() if s.state == DraftState.RESIDENT
                ),
                "loading": [s.id for s in self._slots.values() if s.state == DraftState.LOADING],
            }

    def close(self) -> None:
        """Stop the loader and close every draft (waits for leases held by other threads)."""
        self.release_leases()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._worker.join()
        for s in self._slots.values():
            if s.draft is not None:
                with self._cond:
                    deadline = time.monotonic() + 10.0
                    while s.uses > 0 and time.monotonic() < deadline:
                        self._cond.wait(0.1)
                s.draft.close()
                s.draft, s.state = None, DraftState.ABSENT

    # --- internals (call with the lock held) --------------------------------------------------
    def _slot(self, draft_id: str) -> _Slot:
        s = self._slots.get(draft_id)
        if s is None:
            raise UnknownDraft(
                f"unknown draft {draft_id!r}; known: {', '.join(sorted(self._slots))}",
                param="draft",
            )
        return s

    def _lease(self, s: _Slot) -> Draft:
        leases = getattr(self._tls, "leases", None)
        if leases is None:
            leases = self._tls.leases = {}
        leases[s.id] = leases.get(s.id, 0) + 1
        s.uses += 1
        return s.draft  # type: ignore[return-value]

    def _kick(self) -> None:
        self._idle = False
        self._cond.notify_all()

    def _used(self) -> int:
        return self.reserved_bytes + sum(
            s.bytes or 0 for s in self._slots.values() if s.state in _HOLDS_MEMORY
        )

    def _bytes(self, s: _Slot) -> int | None:
        """Modelled bytes, computed once; None if the file cannot be read (yet)."""
        if s.bytes is None:
            try:
                s.bytes = int(self.source.draft_bytes(s.id))
            except (ModelLoadError, OSError, ValueError) as e:
                s.error = str(getattr(e, "message", e))
                return None
        return s.bytes

    def _pinned_bytes(self) -> int:
        return sum(self._bytes(s) or 0 for s in self._slots.values() if s.pinned)

    def _pending(self, draft_id: str) -> bool:
        return any(c[1] == draft_id for c in self._commands)

    def _wait_settled(self, s: _Slot, op: str = "load") -> None:
        """Wait until `s` is resident or failed, asking again if it was evicted before it was
        seen resident; BudgetExceeded if it cannot fit."""
        settled = (DraftState.RESIDENT, DraftState.FAILED)
        while not self._closed and s.refused is None and s.state not in settled:
            if s.state == DraftState.ABSENT and not self._pending(s.id):
                self._request(s, op)
            self._cond.wait(0.5)
        if s.refused is not None:
            raise BudgetExceeded(s.refused, param="draft")

    def _request(self, s: _Slot, op: str = "load") -> None:
        s.refused = None
        if not any(c == (op, s.id) for c in self._commands):
            self._commands.append((op, s.id))
        self._kick()

    def _victims(self, need: int, keep: set[str], held: bool = False) -> list[_Slot] | None:
        """Resident drafts to evict to free `need` bytes: lowest value per byte first (LRU
        breaks ties). None if pinned, held (unless `held`) or kept drafts leave too little."""
        cands = [
            s
            for s in self._slots.values()
            if s.state == DraftState.RESIDENT
            and (s.bytes or 0) > 0
            and not s.pinned
            and (held or s.holds == 0)
            and s.id not in keep
        ]
        cands.sort(key=lambda s: (s.value / (s.bytes or 1), s.last_used))
        out, freed = [], 0
        for s in cands:
            if freed >= need:
                break
            out.append(s)
            freed += s.bytes or 0
        return out if freed >= need else None

    def _freeing(self) -> int:
        return sum(s.bytes or 0 for s in self._slots.values() if s.state == DraftState.EVICTING)

    def _make_room(self, s: _Slot, keep: set[str]) -> bool | None:
        """True: fits now. False: wait (evictions under way, or a request holds what must
        go). None: it cannot fit (pinned drafts, or the plan's own drafts, are in the way)."""
        need = self._used() + (s.bytes or 0) - self._budget
        if need <= 0:
            return True
        need -= self._freeing()  # already on their way out
        if need <= 0:
            return False
        victims = self._victims(need, keep | {s.id})
        if victims is None:
            # Blocked only by drafts a running request holds: wait for it, do not refuse.
            return None if self._victims(need, keep | {s.id}, held=True) is None else False
        for v in victims:
            v.state = DraftState.EVICTING
        self._changed = True
        return False

    def _next_action(self) -> tuple[str, _Slot] | None:
        # 0. Close evicted drafts nobody holds any more.
        for s in self._slots.values():
            if s.state == DraftState.EVICTING and s.uses == 0:
                return "close", s
        # 1. Over budget (it shrank): evict lowest value per byte first.
        over = self._used() - self._freeing() - self._budget
        if over > 0:
            for v in self._victims(over, set()) or []:
                v.state = DraftState.EVICTING
                self._changed = True
            return None
        # 2. Explicit commands (reactive loads, evictions) in order.
        while self._commands:
            op, draft_id = self._commands[0]
            s = self._slots[draft_id]
            if s.state == DraftState.EVICTING:
                return None  # wait until it is closed (its leases first)
            if op == "evict" and s.state == DraftState.RESIDENT:
                s.state = DraftState.EVICTING
                return self._next_action()
            if op == "evict" or s.state != DraftState.ABSENT:  # nothing (left) to do
                self._commands.popleft()
                continue
            if self._bytes(s) is None:
                self._commands.popleft()
                return "fail", s
            if op == "fill":
                self._commands.popleft()
                if self._used() + (s.bytes or 0) <= self._budget:
                    return "load", s
                self.refusals += 1
                s.refused = (
                    f"draft {s.id!r} needs {format_size(s.bytes or 0)}; "
                    f"{format_size(self._budget - self._used())} of the budget is free"
                )
                continue
            fit = self._make_room(s, set())
            if fit is None:
                self._commands.popleft()
                self.refusals += 1
                s.refused = (
                    f"draft {s.id!r} ({format_size(s.bytes or 0)}) does not fit in the budget "
                    f"{format_size(self._budget)} beside the target and the pinned or in-use "
                    f"drafts ({format_size(self._used())} used)"
                )
                continue
            if fit:
                self._commands.popleft()
                return "load", s
            return None  # evictions first
        # 3. Drafts that take no memory are always resident (unless evicted on purpose).
        if self.autoload_free:
            for s in self._slots.values():
                if s.state == DraftState.ABSENT and not s.evicted and s.bytes == 0:
                    return "load", s
        # 4. Prefetch plan, in priority order: load what fits, evicting what the plan drops.
        keep = set(self._plan) | self._sticky
        for draft_id in self._plan:
            s = self._slots[draft_id]
            if s.state != DraftState.ABSENT or self._bytes(s) is None:
                continue
            fit = self._make_room(s, keep)
            if fit:
                return "load", s
            if fit is False:
                return None  # evictions under way
        return None

    def _run(self) -> None:
        name_os_thread("memspec-drafts")  # loads and calibrations, told apart from decoding
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    self._changed = False
                    action = self._next_action()
                    if action is not None:
                        break
                    if self._changed:
                        continue  # victims marked: close them now
                    if not self._commands and not any(
                        s.state == DraftState.EVICTING for s in self._slots.values()
                    ):
                        self._idle = True
                        self._cond.notify_all()
                    self._cond.wait(1.0)
                op, s = action
                if op == "fail":
                    s.state = DraftState.FAILED
                    self.load_failures += 1
                    self._cond.notify_all()
                    continue
                if op == "load":
                    s.state, s.error = DraftState.LOADING, None
                    self.peak_bytes = max(self.peak_bytes, self._used())
                draft = s.draft
            if op == "close":
                self._close_one(s, draft)
            else:
                self._load_one(s)

    def _close_one(self, s: _Slot, draft: Draft | None) -> None:
        try:
            if draft is not None:
                draft.close()
        except Exception:  # a draft that fails to close is gone all the same
            log.exception("closing draft %s", s.id)
        with self._cond:
            s.draft, s.state = None, DraftState.ABSENT
            self.evictions += 1
            self._kick()

    def _load_one(self, s: _Slot) -> None:
        proc = psutil.Process()
        before = proc.memory_info().rss
        t0 = time.perf_counter()
        draft: Draft | None = None
        error: str | None = None
        try:
            draft = self.source.load_draft(s.id)
            if self.on_loaded is not None:
                self.on_loaded(draft)
        except Exception as e:  # any failure: nothing half-loaded stays behind
            error = str(getattr(e, "message", e)) or type(e).__name__
            if draft is not None:
                with contextlib.suppress(Exception):
                    draft.close()
                draft = None
        dt = time.perf_counter() - t0
        after = proc.memory_info().rss
        with self._cond:
            if error is not None:
                s.state, s.error, s.draft = DraftState.FAILED, error, None
                self.load_failures += 1
                log.warning("draft %s failed to load: %s", s.id, error)
            else:
                self._seq += 1
                s.state, s.draft, s.loaded_seq = DraftState.RESIDENT, draft, self._seq
                s.load_s, s.measured_bytes = dt, after - before
                s.last_used = time.monotonic()
                self.loads += 1
            self._kick()
