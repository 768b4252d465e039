"""The engine worker: one thread owns the models; HTTP handlers talk to it through jobs.

Generation jobs wait in a bounded FIFO (arrival order; full -> 429) until a sequence slot is
free; then they join the batch the engine decodes round by round (Runtime.decode_round), and
leave it when they finish, fail or are cancelled, without disturbing the others. Control jobs
(admin: load, evict, pin, tune; at most `admin_queue` waiting) go ahead of waiting
generations: no new sequence joins while one waits, and it runs once the running ones have
finished; after each, the waiting generations are admitted before the next control job. Each
job streams events back to the asyncio side: `Token` per text delta, then `Done` or `Failed`.

Several models share the budget (memspec.targets): a generation names its model, and waits
in the same queue until that model is resident. The model scheduler (memspec.scheduler.models)
decides which waiting requests may run, when a model that is not resident is loaded, which
idle models make room, whether the switch waits for the resident one's queued run, expiry and
loads ahead of need; this worker keeps the queue and asks it. The load runs on this thread,
between rounds; a model with requests in flight is never unloaded.

The thread loads the Runtime itself (the HTTP server is already answering /health with 503),
beats a heartbeat while idle and per token (the systemd watchdog pings only while it is fresh),
and turns any exception from the engine into a clean per-request error: the next job runs.
Its states are memspec.server.engine_state's; it owns the live settings (`tuning`,
memspec.server.tuning), which tune and reset replace as control jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from memspec.catalog import ModelCatalog
from memspec.compat import name_os_thread
from memspec.config import Settings
from memspec.engine.prefix_cache import PrefixCache
from memspec.engine.speculative import Sequence
from memspec.errors import (
    DeviceUnavailable,
    MemSpecError,
)
from memspec.request_check import ClientRequest
from memspec.runtime import Runtime, abandon_when, drafts_join_later
from memspec.scheduler.models import ModelScheduler
from memspec.server.engine_state import LIVE, EngineState, state_error
from memspec.server.errors import EngineError, NotReady, QueueFull
from memspec.server.metrics import Metrics
from memspec.server.tuning import Tuning
from memspec.targets import Targets
from memspec.units import parse_size

log = logging.getLogger("memspec.server")

IDLE_BEAT_S = 0.5  # the idle loop beats at least this often
DEVICE_RETRY_S = 2.0  # how often an unreachable RPC worker is tried again


# --- events from the engine thread to a request --------------------------------------------


@dataclass
class Token:
    text: str
    # The logprob entries (engine TokenLogprob) of the tokens this text completes, when asked.
    logprobs: list[Any] | None = None


@dataclass
class Done:
    result: Any  # Generation for generation jobs; the control function's return value


@dataclass
class Failed:
    error: MemSpecError | BaseException


Event = Token | Done | Failed


class Job:
    """One unit of work for the engine thread, with a channel back to its request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancel = threading.Event()  # set: stop generating (client gone, shutdown)
        self.enqueued_at = time.monotonic()
        self.started_at: float | None = None

    def post(self, event: Event) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    async def next_event(self) -> Event:
        return await self._events.get()


class GenerateJob(Job):
    def __init__(self, loop: asyncio.AbstractEventLoop, request: ClientRequest, stream: bool):
        super().__init__(loop)
        self.request = request
        self.stream = stream  # post a Token per text delta
        self.model = request.model  # the served name (the worker fills in the default)


class ControlJob(Job):
    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any], name: str):
        super().__init__(loop)
        self.fn = fn  # fn(worker) on the engine thread
        self.name = name


class EngineWorker:
    """Owns the Runtime on one thread; everything that touches models runs here."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        runtime_factory: Callable[[Settings], Runtime] | None = None,
        on_ready: Callable[[], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        fallback: Settings | None = None,
    ):
        # The live tunable settings (tune, reset, tuned.json); `fallback`: the configured
        # settings without the tuned state, tried if the tuned ones cannot load.
        self.tuning = Tuning(settings, fallback)
        self.warnings: list[str] = []  # what the daemon runs without, and why (status)
        self.metrics = metrics
        # A new model serves at once, plain; it calibrates while idle (_calibrate_while_idle).
        self._factory = runtime_factory or functools.partial(
            Runtime, batched=True, defer_calibration=True
        )
        self._on_ready = on_ready
        self._on_fatal = on_fatal
        # The models: every servable one by name, the resident ones' runtimes, and the model
        # scheduler that decides which stay and when to switch (memspec.targets,
        # memspec.scheduler.models).
        self.catalog = ModelCatalog(settings)
        self.targets = Targets(
            self.catalog,
            self._factory,
            lambda: self.settings.budget_bytes,
            on_change=lambda name, what: self.models.changed(name, what),
        )
        self.models = ModelScheduler(
            self.targets,
            self._load_model,
            lambda: self.settings,
            queued=self._queued,
            in_flight=self._in_flight,
            on_change=self._model_changed,
            metrics=metrics,
        )
        self.state = EngineState.STARTING
        self.error: str | None = None
        self._cond = threading.Condition()
        self._queue: deque[GenerateJob] = deque()
        self._control: deque[ControlJob] = deque()
        self._current: Job | None = None  # the control job running
        self._control_ran = False  # the last turn was a control job's (generations go next)
        # (model, slot) -> its generation; which slots are taken is each runtime's slot_table's
        self._active: dict[tuple[str, int], tuple[GenerateJob, Sequence]] = {}
        self._admitting: list[GenerateJob] = []  # taken off the queue, not yet in a slot
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self.heartbeat = time.monotonic()
        self.requests_served = 0
        self._recent: deque[tuple[float, int, float]] = deque(maxlen=256)  # (end, tokens, s)
        self.prefix_cache = PrefixCache(self._cache_capacity)

    @property
    def settings(self) -> Settings:
        """The settings the engine runs with now (frozen; a tune replaces them)."""
        return self.tuning.current

    @property
    def budget_bytes(self) -> int:
        """The budget now (the resident models' working sets hold shares of it)."""
        return self.settings.budget_bytes

    @property
    def default_model(self) -> str:
        """The name a request without `model` is served by (the configured target)."""
        return self.catalog.default_name

    @property
    def runtime(self) -> Runtime | None:
        """The configured target's runtime when resident, else the most recently used
        resident model's; None while none is (loading, reloading, all unloaded)."""
        runtimes = dict(self.targets.runtimes)
        rt = runtimes.get(self.default_model)
        if rt is not None or not runtimes:
            return rt
        return runtimes[max(runtimes, key=lambda n: self.targets.stat(n).last_used)]

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="memspec-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY and self._accepting

    @property
    def heartbeat_age_s(self) -> float:
        return time.monotonic() - self.heartbeat

    def healthy(self, stale_s: float) -> bool:
        """Ready and the engine thread beat within `stale_s` (a stuck engine stops beating)."""
        # Waiting for a device is healthy: the engine beats, and a restart would not help.
        return self.state in LIVE and time.monotonic() - self.heartbeat < stale_s

    def stop_accepting(self) -> None:
        """Shutdown, phase 1: refuse new jobs, fail the waiting ones."""
        with self._cond:
            self._accepting = False
            waiting = list(self._queue) + list(self._control)
            self._queue.clear()
            self._control.clear()
        for job in waiting:
            job.post(Failed(NotReady("the daemon is shutting down", code="shutting_down")))

    def cancel_running(self) -> None:
        """Shutdown, phase 2: cut the running generations (their streams end cleanly)."""
        with self._cond:
            if self._current is not None:
                self._current.cancel.set()
            for job, _ in self._active.values():
                job.cancel.set()
            for job in self._admitting:
                job.cancel.set()

    @property
    def busy(self) -> bool:
        return self._current is not None or bool(self._active) or bool(self._admitting)

    @property
    def slots(self) -> int:
        """Sequences the engine decodes together (the resident targets' slots)."""
        return max(1, sum(rt.slots for rt in list(self.targets.runtimes.values())))

    @property
    def active_slots(self) -> int:
        return len(self._active)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the thread and close the Runtime; False if the engine did not stop in time."""
        self.stop_accepting()
        self.cancel_running()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- submitting -----------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def retry_after_s(self) -> int:
        durations = [s for _, _, s in list(self._recent)[-16:]]
        mean = sum(durations) / len(durations) if durations else 1.0
        return max(1, min(60, math.ceil(mean * (len(self._queue) + 1))))

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self._accepting or self._stop:
                raise NotReady("the daemon is shutting down", code="shutting_down")
            refused = state_error(self.state, self.error)
            if refused is not None:
                raise refused
            if isinstance(job, GenerateJob):
                job.model = job.model or self.default_model
                self.models.arrive(job.model, time.monotonic())
            if isinstance(job, ControlJob):
                # Bounded: each admin job holds back new generations while it waits.
                if len(self._control) >= self.settings.admin_queue:
                    raise QueueFull(
                        f"admin queue is full ({len(self._control)} waiting, admin_queue "
                        f"{self.settings.admin_queue}); retry later",
                        self.retry_after_s(),
                    )
                self._control.append(job)
            else:
                # max_queue requests wait beyond the slots' running ones.
                in_system = len(self._queue) + len(self._active) + len(self._admitting)
                if in_system >= self.settings.max_queue + self.slots:
                    raise QueueFull(
                        f"request queue is full ({len(self._queue)} waiting, "
                        f"max_queue {self.settings.max_queue}); retry later",
                        self.retry_after_s(),
                    )
                self._queue.append(job)  # type: ignore[arg-type]
            self._cond.notify_all()

    # --- the thread -----------------------------------------------------------------------
    def _main(self) -> None:
        name_os_thread("memspec-engine")  # and llama.cpp's workers, which it starts
        self.state = EngineState.LOADING
        try:
            t0 = time.monotonic()
            rt = self._load_when_devices_answer()
            if rt is None:  # stopped while waiting
                self.state = EngineState.STOPPED
                return
            self.targets.adopt(self.default_model, rt, time.monotonic() - t0)
        except BaseException as e:  # noqa: BLE001 - reported, then the daemon exits
            self.state, self.error = EngineState.FAILED, str(getattr(e, "message", e))
            log.error("loading models failed: %s", self.error)
            if self._on_fatal is not None:
                self._on_fatal(e)
            return
        self.state, self.error = EngineState.READY, None
        self.heartbeat = time.monotonic()
        self._beat_through_waits(rt)
        self._observe_residency()
        if self._on_ready is not None:
            self._on_ready()
        try:
            self._loop()
        except BaseException as e:  # a bug: said in /health, then the daemon exits (restarted)
            log.exception("the engine thread died")
            self.state, self.error = EngineState.FAILED, f"engine thread died: {e!r}"
            self._fail_everything(EngineError(f"{self.error}; the daemon exits to be restarted"))
            if self._on_fatal is not None:
                self._on_fatal(e)
        finally:
            self.state = EngineState.STOPPING
            try:
                self.targets.close()
            finally:
                self.state = EngineState.STOPPED

    def _fail_everything(self, error: MemSpecError) -> None:
        """Every waiting and running request fails with `error` (the engine cannot go on)."""
        with self._cond:
            jobs = [*self._queue, *self._admitting, *(j for j, _ in self._active.values())]
            jobs += list(self._control)
            self._queue.clear()
            self._control.clear()
        for job in jobs:
            job.post(Failed(error))

    def _load_when_devices_answer(self) -> Runtime | None:
        """The first load; while an RPC worker the target is split over cannot be reached, the
        daemon stays up (/health 503 with the reason) and tries again every DEVICE_RETRY_S."""
        while True:
            try:
                return self._first_load()
            except DeviceUnavailable as e:
                if self.state is not EngineState.WAITING_FOR_DEVICE:
                    log.error("waiting for a device: %s", e.message)
                    self.state, self.error = EngineState.WAITING_FOR_DEVICE, e.message
                    if self._on_ready is not None:  # up (503 with the reason): READY to systemd
                        self._on_ready()
                self.error = e.message
            with self._cond:
                self.heartbeat = time.monotonic()
                if self._stop:
                    return None
                self._cond.wait(DEVICE_RETRY_S)
                if self._stop:
                    return None

    def _first_load(self) -> Runtime:
        """Load with the tuned settings; if they cannot load (a budget below the target, an
        n_ctx that does not fit), with the configured ones, and set the tuned values aside:
        a bad tune must not keep the daemon from starting on every restart."""
        try:
            rt = self._factory(self.settings)
        except DeviceUnavailable:  # not the tune's fault: wait for the device, keep the tune
            raise
        except Exception as e:
            if not self.tuning.tuned_at_start:
                raise
            why = str(getattr(e, "message", e))
            tuned = self.tuning.fall_back()
            log.error("loading with the tuned settings %s failed: %s; trying without", tuned, why)
            rt = self._factory(self.settings)
            aside = self.tuning.reject_file()
            where = f"set aside as {aside}" if aside else "could not be set aside"
            self.warnings.append(
                f"tuned settings {', '.join(tuned)} were not applied at start ({why}); "
                f"running on the configured values; the tuned file {where}"
            )
        self._check_policy(rt)
        self._check_batch_invariance(rt)
        for name, why in getattr(rt, "manifest_errors", {}).items():
            self.warnings.append(f"draft manifest {name} left out: {why}")
        for name, why in getattr(rt, "preload_errors", {}).items():
            self.warnings.append(f"draft {name} not loaded at start: {why}")
        return rt

    def _check_batch_invariance(self, rt: Runtime) -> None:
        """Say so when the target's kernels depend on the batch shape: greedy output can then
        differ from plain decoding at a near-tie (see memspec/backends/llama_cpp.py)."""
        if rt.target.describe().get("batch_invariant", True):
            return
        if self.settings.exactness == "numeric":  # asked for: said in /admin/status, no warning
            log.info("exactness numeric: the target's batched passes run llama.cpp's own kernels")
            return
        msg = (
            "the target's kernels are not known to be batch-invariant (llama.cpp built with "
            "llamafile, or layers on a GPU): at a floating-point near-tie, speculative output "
            "can differ from plain decoding; scripts/setup.sh builds llama.cpp without llamafile"
        )
        log.warning(msg)
        self.warnings.append(msg)

    def _check_policy(self, rt: Runtime) -> None:
        """An unknown policy name would fail every request: run on a known one, and say so."""
        known = rt.policies
        name = self.settings.policy
        if name in known:
            return
        fb = self.tuning.configured.policy if self.tuning.tuned_at_start else None
        use = fb if fb in known else "auto" if "auto" in known else None
        if use is None:
            return
        self.tuning.replace_policy(use)
        self.tuning.hand_to_runtime(rt)
        msg = f"policy {name!r} is unknown (known: {', '.join(sorted(known))}); using {use!r}"
        log.error(msg)
        self.warnings.append(msg)

    def _loop(self) -> None:
        """Admit waiting generations into free slots, run a round, repeat; control jobs run
        when no generation is active (none joins while one waits)."""
        while True:
            if self.state is EngineState.DEVICE_LOST and not self._active:
                if not (self._stop or not self._accepting) and self._restore_device():
                    continue
                with self._cond:
                    self.heartbeat = time.monotonic()
                    if self._stop:
                        return
                    self._cond.wait(DEVICE_RETRY_S)
                continue
            self._housekeep()
            control: ControlJob | None = None
            admit: list[GenerateJob] = []
            load: str | None = None
            with self._cond:
                self.heartbeat = time.monotonic()
                # Control and generation take turns: after a control job, what waited for it
                # is admitted before the next one, so admin jobs cannot starve generation.
                control_turn = bool(self._control) and not (self._control_ran and self._queue)
                if control_turn and not self._active:
                    control = self._current = self._control.popleft()
                    self._control_ran = True
                elif not control_turn:
                    admit, load = self._schedule_or_fail()  # the admitted join _admitting
                    if admit or not self._queue:
                        self._control_ran = False
                if control is None and not admit and load is None and not self._active:
                    if self._stop:
                        return
                    self._cond.wait(IDLE_BEAT_S)
                    continue
            if control is not None:
                self._run_control(control)
                continue
            if load is not None:
                self._make_resident(load)
            for job in admit:
                # _admit fails a bad request itself; what escapes it (a bug) leaves the job in
                # _admitting, for _main to fail it with the reason.
                self._admit(job, alone=len(admit) == 1 and not self._active)
                with self._cond:
                    self._admitting.remove(job)
            if self._active:
                self._round()
            self._check_device()

    # --- which model runs: the model scheduler asks, the queue answers ------------------------
    def _schedule(self) -> tuple[list[GenerateJob], str | None]:
        """Under the lock: the waiting generations to admit now and the model to load, if
        one is due (memspec.scheduler.models); requests whose clients left or that waited past
        queue_timeout_s leave the queue, and those for a model that cannot be served fail."""
        waiting = [j for j in self._queue if not j.cancel.is_set()]  # the rest: clients left
        now = time.monotonic()
        timeout = self.settings.queue_timeout_s
        for job in [j for j in waiting if now - j.enqueued_at > timeout]:
            waiting.remove(job)
            loading = "" if job.model in self.targets.runtimes else " (its model is not loaded)"
            job.post(
                Failed(
                    NotReady(
                        f"waited {now - job.enqueued_at:.0f} s in the queue for model "
                        f"{job.model!r}{loading}, more than queue_timeout_s {timeout:g}; "
                        "retry later",
                        code="queue_timeout",
                        retry_after_s=self.retry_after_s(),
                    )
                )
            )
        plan = self.models.plan(waiting, self._in_flight(), now)
        self._admitting.extend(plan.admit)  # in flight from here on: never a victim
        admitted = set(map(id, plan.admit))
        keep: deque[GenerateJob] = deque()
        for job in waiting:
            if id(job) in admitted:
                continue
            if job.model in plan.failed:
                job.post(Failed(plan.failed[job.model]))
            else:
                keep.append(job)
        self._queue = keep
        return plan.admit, plan.load

    def _schedule_or_fail(self) -> tuple[list[GenerateJob], str | None]:
        """_schedule; if it raises (a bug), the waiting requests fail with the error rather
        than the engine thread (which would take every model down)."""
        try:
            return self._schedule()
        except Exception as e:  # noqa: BLE001 - the engine must go on serving
            log.exception("scheduling the waiting requests failed")
            waiting = list(self._queue)
            self._queue.clear()
            for job in waiting:
                job.post(Failed(e))
            return [], None

    def _in_flight(self) -> Counter[str]:
        """Requests per model decoding or being admitted (their model is never a victim)."""
        with self._cond:
            in_flight = Counter(model for model, _ in self._active)
            in_flight.update(j.model for j in self._admitting)
        return in_flight

    def _queued(self) -> Counter[str]:
        """Requests per model waiting, their clients still there."""
        with self._cond:
            return Counter(j.model for j in self._queue if not j.cancel.is_set())

    def _make_resident(self, name: str) -> None:
        """Load `name` for its waiting requests (the model scheduler picks what it unloads);
        a load that fails fails them, and the daemon goes on serving."""
        with self._cond:
            stalled = sum(j.model == name for j in self._queue) + len(self._active)
        error = self.models.load_for_waiting(name, stalled)
        if error is None:
            return
        with self._cond:
            for job in [j for j in self._queue if j.model == name]:
                self._queue.remove(job)
                job.post(Failed(error))

    def _load_model(self, name: str, abandon: Callable[[], bool], ahead: bool) -> None:
        """The model scheduler's loader: `name` into the free budget, on this thread, beating
        the heartbeat; it stops part way once abandon() is true. For waiting requests the
        target comes first and its drafts join when they pay (drafts_join_later)."""
        join_later = contextlib.nullcontext() if ahead else drafts_join_later()
        with self._beating(), abandon_when(abandon), join_later:
            self.targets.load(name, self.settings, victims=[])

    @contextlib.contextmanager
    def _beating(self) -> Iterator[None]:
        """Beat the heartbeat while a model loads on this thread (a load is bounded work in
        llama.cpp, not a stuck engine: the watchdog must not kill the daemon over it)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(IDLE_BEAT_S / 2):
                self.heartbeat = time.monotonic()

        t = threading.Thread(target=beat, name="memspec-load-beat", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
            self.heartbeat = time.monotonic()

    def _housekeep(self) -> None:
        try:
            self._expire_and_prefetch()
        except Exception:  # noqa: BLE001 - the engine must go on serving
            log.exception("model housekeeping failed")
        self._calibrate_while_idle()

    def _calibrate_while_idle(self) -> None:
        """The calibrations models left for later (Runtime.calibrate_pending), while no job
        runs or waits: one that comes waits for the timed pass in hand, not the rest."""

        def stop() -> bool:
            self.heartbeat = time.monotonic()  # a pass at a time: the engine is not stuck
            return bool(self._stop or self._queue or self._control or self._active
                        or self._admitting)  # fmt: skip

        for rt in list(self.targets.runtimes.values()):
            if stop() or not rt.calibrate_pending(stop):
                return

    def _expire_and_prefetch(self) -> None:
        """keep_alive expiry and loads ahead of need (the model scheduler's), between jobs."""
        with self._cond:
            busy = {m for m, _ in self._active} | {j.model for j in self._queue}
            busy |= {j.model for j in self._admitting}
            idle = not (self._queue or self._active or self._control or self._admitting)
        self.models.housekeep(busy, idle, time.monotonic())

    def _model_changed(self, name: str, what: str) -> None:
        if what in ("evict", "expire", "unload"):
            self.prefix_cache.drop_partition(name)
        if self.metrics is not None:
            self.metrics.observe_model_change(name, what)

    # Control jobs (Ollama's keep_alive 0 and empty request, memspec-ctl, the embedding
    # routes): the model scheduler does them; the in-flight requests have finished.
    def unload_model(self, name: str) -> bool:
        return self.models.unload(name, "unload")

    def load_model(self, name: str, keep_alive_s: float | None = None) -> None:
        self.models.load(name, keep_alive_s)

    def load_embedder(self, name: str) -> None:
        self.models.load_embedder(name)

    def single_target(self) -> Runtime:
        """Engine thread: only the configured target resident (a live tune applies to it)."""
        for name in [n for n in self.targets.runtimes if n != self.default_model]:
            self.targets.unload(name, "unload")
        if self.default_model not in self.targets.runtimes:
            self.models.make_resident(self.default_model)
        return self.targets.runtimes[self.default_model]

    def models_status(self) -> list[dict[str, Any]]:
        """Every servable model: its state, bytes, share, expiry, loads, evictions."""
        return self.models.status(time.monotonic(), time.time())

    def _check_device(self) -> None:
        """A target whose RPC worker was lost (backends/isolated.py): its requests have failed;
        the daemon stops taking new ones until the worker is back."""
        rt = self.runtime
        lost = getattr(rt.target, "lost", None) if rt is not None else None
        if lost is None or self.state is EngineState.DEVICE_LOST:
            return
        with self._cond:
            self.state, self.error = EngineState.DEVICE_LOST, lost
            waiting = list(self._queue)
            self._queue.clear()
        for job in waiting:
            job.post(Failed(DeviceUnavailable(lost)))

    def _restore_device(self) -> bool:
        """Try to bring the target back (its workers answer again): True once it is."""
        rt = self.runtime
        assert rt is not None
        try:
            rt.target.restart()  # type: ignore[attr-defined]
        except DeviceUnavailable as e:
            self.error = e.message
            return False
        except Exception as e:  # noqa: BLE001 - tried again later
            log.exception("restarting the target failed")
            self.error = str(e)
            return False
        log.info("the target's devices answer again; serving")
        self.state, self.error = EngineState.READY, None
        return True

    def _run_control(self, job: ControlJob) -> None:
        job.started_at = time.monotonic()
        try:
            job.post(Done(job.fn(self)))
        except MemSpecError as e:
            job.post(Failed(e))
        except Exception as e:  # noqa: BLE001 - the next request must still work
            log.exception("engine error on a control job")
            job.post(Failed(e))
        finally:
            with self._cond:
                self._current = None
            self.heartbeat = time.monotonic()
            self._observe_residency()

    def _observe_residency(self) -> None:
        if self.metrics is None:
            return
        rt = self.runtime
        if rt is not None:
            self.metrics.observe_residency(rt.draft_admin.draft_status())
        self.models.observe()

    # --- generation -----------------------------------------------------------------------
    def _admit(self, job: GenerateJob, alone: bool = True) -> None:
        """Check the request, pick its slot (the free one whose KV shares the most with the
        prompt), ready the slot's KV from the prefix cache and open the sequence; a bad
        request fails here, alone."""
        job.started_at = time.monotonic()
        rt = self.targets.runtime(job.model)
        assert rt is not None  # admitted only while its model is resident

        opened: list[Sequence] = []  # the sequence, once open: its logprobs go with the text
        sent = 0  # its logprob entries posted so far

        def on_token(delta: str, _token: int | None) -> None:
            nonlocal sent
            self.heartbeat = time.monotonic()
            if job.stream and delta:
                logprobs = opened[0].gen.logprobs if opened else None
                if logprobs is not None:
                    logprobs, sent = logprobs[sent:], len(logprobs)
                job.post(Token(delta, logprobs))

        slot: int | None = None
        try:
            req = rt.requests.check(job.request)  # the one check: a clean 4xx before anything runs
            # A model's cached prefixes are its own: its name heads the partition.
            partition = f"{job.model}\x00{req.cache_partition}"
            slot = rt.slot_table.take(req.prompt, partition)
            assert slot is not None  # admitted only into a free slot
            rt.prepare_prefix(self.prefix_cache, req.prompt, not req.draft.plain, slot, partition)
            seq = rt.open_sequence(req, slot, on_token, job.cancel, alone=alone)
            opened.append(seq)
        except Exception as e:  # noqa: BLE001 - the others must still run
            if slot is not None:  # taken, but no sequence holds it
                rt.slot_table.release(slot)
            if not isinstance(e, MemSpecError):
                log.exception("engine error starting a generation")
            job.post(Failed(e))
            return
        with self._cond:
            self._active[(job.model, slot)] = (job, seq)
        self.models.admitted(job.model)

    def _round(self) -> None:
        """One round of every active sequence, model by model; the finished ones leave with
        their result."""
        active = list(self._active.items())
        for model in dict.fromkeys(m for m, _ in self._active):
            rt = self.targets.runtime(model)
            assert rt is not None  # a model with sequences in flight is never unloaded
            seqs = [seq for (m, _), (_, seq) in active if m == model]
            try:
                n_seq, n_tokens = rt.decode_round(seqs)
                if self.metrics is not None and n_tokens:
                    self.metrics.observe_round(n_seq, n_tokens)
            except Exception as e:  # noqa: BLE001 - outside any one sequence: all of them fail
                log.exception("engine error in a decode round")
                for seq in seqs:
                    seq.fail(e)
        self.heartbeat = time.monotonic()
        finished = [(key, job, seq) for key, (job, seq) in active if seq.done]
        if not finished:
            return
        with self._cond:
            for (model, slot), _, _ in finished:
                del self._active[(model, slot)]
                # The sequence has ended, however it ended: its slot is free for the next.
                self.targets.runtimes[model].slot_table.release(slot)
        now = time.monotonic()
        for (model, _), job, seq in finished:
            rt = self.targets.runtime(model)
            assert rt is not None
            self.models.finished(model, job.request.keep_alive_s, now)
            try:
                gen = rt.close_sequence(seq)
            except MemSpecError as e:
                job.post(Failed(e))
                continue
            except Exception as e:  # noqa: BLE001 - the next request must still work
                log.error("generation failed: %r", e)
                job.post(Failed(e))
                continue
            queued_s = (job.started_at or job.enqueued_at) - job.enqueued_at
            self.requests_served += 1
            self._recent.append((time.monotonic(), gen.completion_tokens, gen.elapsed_s))
            job.post(Done(gen))
            if self.metrics is not None:
                per_draft = {d: (c["proposed"], c["accepted"]) for d, c in gen.per_draft.items()}
                try:
                    self.metrics.observe_generation(gen, per_draft, queued_s)
                except Exception:  # noqa: BLE001 - metrics must never stop the engine
                    log.exception("recording a generation's metrics failed")
        try:
            self._observe_residency()
        except Exception:  # noqa: BLE001
            log.exception("recording draft residency failed")

    def reload_runtime(self, shape: dict[str, Any]) -> None:
        """Rebuild the Runtime with a new context (`shape`: n_ctx, parallel, KV cache types,
        flash_attn: tuning.RELOAD_KEYS), keeping resident and pinned drafts.

        Engine thread only (a control job). If the new context cannot load, the old one is
        loaded again and the error raised; if even that fails the daemon reports it and exits.
        """
        rt = self.single_target()
        rows = rt.draft_admin.draft_status()
        resident = [r["id"] for r in rows if r["resident"]]
        pinned = [r["id"] for r in rows if r["pinned"]]
        old = self.tuning.shape()
        self.state = EngineState.RELOADING
        self.prefix_cache.clear()
        self.targets.runtimes.pop(self.default_model, None)
        rt.close()
        try:
            self.tuning.set_shape(shape)
            self._load(pinned, resident)
        except BaseException:
            self.tuning.set_shape(old)
            try:
                self._load_waiting_for_devices(pinned, resident)
            except BaseException as e:
                self.state, self.error = EngineState.FAILED, str(getattr(e, "message", e))
                if self._on_fatal is not None:
                    self._on_fatal(e)
                raise
            raise

    def _load_waiting_for_devices(self, pinned: list[str], drafts: list[str]) -> None:
        """_load; while an RPC worker is unreachable, wait for it (state waiting_for_device)
        rather than fail the daemon over a device that may come back."""
        while True:
            try:
                self._load(pinned, drafts)
                return
            except DeviceUnavailable as e:
                self.state, self.error = EngineState.WAITING_FOR_DEVICE, e.message
            with self._cond:
                self.heartbeat = time.monotonic()
                if self._stop:
                    raise NotReady("the daemon is shutting down", code="shutting_down")
                self._cond.wait(DEVICE_RETRY_S)

    def _load(self, pinned: list[str], drafts: list[str]) -> None:
        """A new Runtime on the settings now, preloading `drafts` (those resident before)."""
        t0 = time.monotonic()
        rt = self._factory(self.settings.model_copy(update={"drafts": drafts}))
        self.targets.adopt(self.default_model, rt, time.monotonic() - t0)
        for draft_id in pinned:
            rt.draft_admin.pin(draft_id, True)
        self.state, self.error = EngineState.READY, None
        self.heartbeat = time.monotonic()
        self._beat_through_waits(rt)

    def _beat_through_waits(self, rt: Runtime) -> None:
        """A target in its own process waits for it in slices: beat meanwhile (watchdog)."""
        if hasattr(rt.target, "on_wait"):
            rt.target.on_wait = lambda: setattr(self, "heartbeat", time.monotonic())

    # --- KV reuse across sessions -----------------------------------------------------------
    def prefix_cache_capacity(self) -> int:
        """The prefix cache's byte bound now (status; the soak run checks it is kept)."""
        try:
            return self._cache_capacity()
        except Exception:  # noqa: BLE001 - status must not fail on a runtime mid-reload
            return 0

    def _cache_capacity(self) -> int:
        try:
            cap = parse_size(self.settings.prefix_cache)
        except ValueError:
            return 0
        if not self.targets.runtimes or cap <= 0:
            return 0
        return max(0, min(cap, self.budget_bytes - self.targets.used_bytes()))

    # --- status ---------------------------------------------------------------------------
    def tokens_per_s_recent(self, window_s: float = 60.0) -> float:
        now = time.monotonic()
        rows = [(t, n, s) for t, n, s in list(self._recent) if now - t <= window_s]
        tokens, seconds = sum(n for _, n, _ in rows), sum(s for _, _, s in rows)
        return round(tokens / seconds, 2) if seconds > 0 else 0.0
