"""Measure this device's costs: target verify time per batch size, draft time per token.

Results are cached under the data directory, the target's per (target file, backend, threads,
k range) and each draft's per draft beside it, so neither a restart nor a runtime with another
set of drafts pays for calibration again; `memspec calibrate --force` re-measures.

A Calibration measures in pieces of one forward pass each, and can stop between any two: the
daemon runs a new model's calibration while no request runs (Runtime.calibrate_pending), and a
request that arrives waits for the pass in hand, not for the rest. Each piece first puts back
the context it measures at if a request changed the KV cache meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import psutil

from memspec.backends.base import Backend
from memspec.engine.costs import CostModel
from memspec.engine.types import Draft, ModelBacked, SamplingParams
from memspec.paths import cache_dir

CONTEXT_TOKENS = 128  # a typical context length at which the costs are measured
REPS = 7
# Bumped when what is measured changes (2: verification reads each row's argmax in place;
# 3: batch sizes timed interleaved, the curve made non-decreasing).
MEASURE_VERSION = 3
DRAFT_CACHE_PREFIX = "calibration-draft-"  # one file per draft measured after start-up
# A calibration taken while other processes used more than this share of the machine's CPU is
# used for the run that measured it but not cached: a cache written while tests ran beside it
# held a 1.5B-like curve for SmolLM2 (84 / 183 / 254 ms for 1 / 2 / 4 rows, where a quiet box
# measures about 33 / 41 / 55), and every later run's decision rule drafted by it.
BUSY_SHARE = 0.25
MIN_LOAD_WALL_S = 0.5  # a shorter measurement is not judged (nor much exposed to others)

# What this process measured, by cache file name, cached on disk or not: a model that is
# unloaded and loaded again (a switch between models under one budget) never measures again,
# even when its first measurement ran too busy to be written to disk (under load a 1.5B's
# curve took over a minute of each reload).
_measured: dict[str, dict] = {}

log = logging.getLogger(__name__)

T = TypeVar("T")


class OthersLoad:
    """The share of the machine's CPU time others (processes, the hypervisor) took while the
    block ran."""

    def __enter__(self) -> OthersLoad:
        self._proc = psutil.Process()
        self._t0 = time.perf_counter()
        self._sys0 = _busy(psutil.cpu_times())
        self._own0 = sum(self._proc.cpu_times()[:2])
        self.share = self.others_s = self.wall_s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        own = sum(self._proc.cpu_times()[:2]) - self._own0
        self.others_s = max(0.0, _busy(psutil.cpu_times()) - self._sys0 - own)
        self.share = others_share(self.others_s, self.wall_s)


def others_share(others_s: float, wall_s: float) -> float:
    """Others' CPU seconds as a share of the machine's over `wall_s`; 0 when too short to tell
    (CPU times tick every 10 ms)."""
    if wall_s < MIN_LOAD_WALL_S:
        return 0.0
    return others_s / max(wall_s * (os.cpu_count() or 1), 1e-9)


def _busy(t: object) -> float:
    """CPU seconds not idle, the hypervisor's steal included (another VM's load slows a
    measurement as much as a process beside it)."""
    fields = ("user", "nice", "system", "irq", "softirq", "steal")
    return float(sum(getattr(t, f, 0.0) for f in fields))


def _median_time(fn, reps: int = REPS) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _warm_context(
    backends: list[Backend], n_vocab: int = 10000, tokens: int = CONTEXT_TOKENS
) -> list[int]:
    """`tokens` tokens, the same every time, fed to each of `backends` from empty."""
    rng = np.random.default_rng(0)
    warm = [int(t) for t in rng.integers(100, min(10000, n_vocab), size=tokens)]
    for be in backends:
        be.reset()
        be.eval(warm, all_logits=False)
    return warm


def _rewarm(backends: list[Backend], warm: list[int]) -> None:
    """Put `warm` back in the caches a request used between two pieces of a calibration."""
    for be in backends:
        if be.tokens != warm:
            be.reset()
            be.eval(warm, all_logits=False)


def _file_key(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def cache_key(target: Backend, drafts: list[Draft], k_max: int, extra: str = "") -> str:
    parts = [
        _file_key(target.path),
        target.describe(),
        os.cpu_count(),
        platform.machine(),
        platform.processor(),
        k_max,
        extra,
        MEASURE_VERSION,
        sorted((d.id, _file_key(d.backend.path)) for d in drafts if isinstance(d, ModelBacked)),
    ]
    heads = sorted(
        (d.id, _file_key(d.path) if hasattr(d, "path") else None)
        for d in drafts
        if d.token_step() is not None
    )
    if heads:  # (appended only when present: earlier caches keep their keys)
        parts.append(heads)
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def measure_verify(
    target: Backend, k_max: int, full_rows: bool = False, context_tokens: int = CONTEXT_TOKENS
) -> list[float]:
    """Seconds to verify 1..k_max+1 tokens at `context_tokens` of context, reading what greedy
    acceptance reads (each row's argmax); `full_rows`: copying every row out instead (what
    verification cost before it read rows in place: the gap grows with the vocabulary). The
    calibration measures at CONTEXT_TOKENS; a long context adds attention over its cache to
    every row, so the curve there is steeper (`bench engine` measures it at its prompts').

    The sizes are timed in turns (1, 2, ..., then back down), not each one's repetitions in a
    row: a burst of load from elsewhere then falls on every size alike instead of inflating
    one. Timed in a row on a box losing CPU to steal, the cache held 95 ms for 5 tokens and
    76 ms for 7; the rule then shunned k = 4, so the online correction never saw that size.
    Last, the medians are made non-decreasing (a larger batch never costs less)."""
    return _run(verify_passes(target, k_max, full_rows, context_tokens))


def verify_passes(
    target: Backend, k_max: int, full_rows: bool = False, context_tokens: int = CONTEXT_TOKENS
) -> Generator[None, None, list[float]]:
    """measure_verify one timed pass at a time (it yields after each): its curve is the
    generator's return value."""
    warm = _warm_context([target], target.n_vocab, context_tokens)
    sizes = list(range(1, k_max + 2))

    def step(batch: int) -> float:
        _rewarm([target], warm)
        t = time.perf_counter()
        if full_rows:
            target.eval(warm[:batch], copy=True)
        else:
            target.eval_argmax(warm[:batch])
        seconds = time.perf_counter() - t
        target.truncate(context_tokens)
        return seconds

    for batch in sizes:  # warm-up
        step(batch)
        yield
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for rep in range(REPS):
        for batch in sizes if rep % 2 == 0 else reversed(sizes):
            times[batch].append(step(batch))
            yield
    target.reset()
    return non_decreasing([statistics.median(times[b]) for b in sizes])


def _run(passes: Generator[None, None, T]) -> T:
    """A measurement's passes, all of them: its result."""
    while True:
        try:
            next(passes)
        except StopIteration as done:
            return done.value


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a run
    that falls is replaced by its mean."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def measure_features_cost(target: Backend, k_max: int) -> tuple[list[float], list[float]]:
    """Seconds to verify 1..k_max+1 tokens without and with target features (issue 11: what
    a draft that reads the target's hidden states costs the target). `target` is timed as it
    is loaded, against a twin loaded from the same file with `features` the other way (its
    weights are held twice meanwhile), batch sizes alternating between the two so that load
    from other processes falls on both alike. A features run reads what such a draft reads:
    each row's argmax, then last_features(). Returns (off, on); the twin is closed."""
    twin = type(target)(target.path, replace(target.options, features=not target.options.features))
    off, on = (twin, target) if target.options.features else (target, twin)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        warm = _warm_context([off, on], target.n_vocab)
        for batch in range(1, k_max + 2):
            for features, be in ((False, off), (True, on)):

                def step(be: Backend = be, probe: list[int] = warm[:batch]) -> None:
                    be.eval_argmax(probe)
                    if be.options.features:
                        be.last_features()
                    be.truncate(CONTEXT_TOKENS)

                step()  # warm-up
                times[features].append(_median_time(step))
    finally:
        target.reset()
        twin.close()
    return times[False], times[True]


def measure_batch(target: Backend, max_tokens: int) -> dict[int, float]:
    """Seconds for one forward pass of n tokens spread over all of the target's sequence
    slots (each at CONTEXT_TOKENS of context), for n = 1, 2, 4, ... max_tokens: the cost
    of a batched round (costs.plan_batch)."""
    return _run(batch_passes(target, max_tokens))


def batch_passes(target: Backend, max_tokens: int) -> Generator[None, None, dict[int, float]]:
    """measure_batch one timed pass at a time (it yields after each)."""
    slots = target.slots
    warm = _warm_context(slots, target.n_vocab)
    sizes = sorted({min(2**i, max_tokens) for i in range(max_tokens.bit_length() + 1)})
    out: dict[int, float] = {}
    for n in sizes:
        per = [n // len(slots) + (1 if i < n % len(slots) else 0) for i in range(len(slots))]
        items = [(slot, warm[:m], m) for slot, m in zip(slots, per, strict=True) if m]

        def step(items: list = items) -> float:
            _rewarm(slots, warm)
            t = time.perf_counter()
            for out_rows in target.eval_many(items):
                out_rows.argmax(axis=1)
            seconds = time.perf_counter() - t
            for slot, _, _ in items:
                slot.truncate(CONTEXT_TOKENS)
            return seconds

        step()  # warm-up
        yield
        times = []
        for _ in range(5):
            times.append(step())
            yield
        out[n] = statistics.median(times)
    for slot in slots:
        slot.reset()
    return out


def measure(target: Backend, drafts: list[Draft], k_max: int) -> CostModel:
    costs = _run(target_passes(target, k_max))
    for d in drafts:
        measure_draft(d, costs, k_max)
    return costs


def target_passes(target: Backend, k_max: int) -> Generator[None, None, CostModel]:
    """The target's verify curve, then (several sequence slots) its batch curve, one timed
    pass at a time."""
    costs = CostModel(verify_s=(yield from verify_passes(target, k_max)))
    if len(target.slots) > 1:
        costs.batch_s = yield from batch_passes(target, min(len(target.slots) * (k_max + 1), 64))
    return costs


def measure_draft(d: Draft, costs: CostModel, k_max: int) -> None:
    """Add one draft's cost to `costs`: seconds per token (models) or per round (lookups)."""
    rng = np.random.default_rng(0)
    warm = _warm_context([d.backend] if isinstance(d, ModelBacked) else [])
    if isinstance(d, ModelBacked):
        be = d.backend

        def one() -> None:
            be.eval([warm[0]], all_logits=False)
            be.truncate(CONTEXT_TOKENS)

        one()
        costs.draft_s[d.id] = _median_time(one)
        be.reset()
    elif (step := d.token_step()) is not None:  # per-token drafts without a Backend (heads)
        step()
        costs.draft_s[d.id] = _median_time(step)
    else:  # lookup-style drafts: a per-round overhead, measured on a long context
        ctx = warm * 4
        costs.draft_overhead_s[d.id] = _median_time(
            lambda: d.propose(ctx, k_max, SamplingParams(), rng)
        )


def _draft_cache(target: Backend, d: Draft, k_max: int) -> Path:
    return cache_dir() / f"{DRAFT_CACHE_PREFIX}{cache_key(target, [d], k_max, d.id)}.json"


def _draft_tables(costs: CostModel) -> dict[str, dict[str, float]]:
    return {"draft_s": costs.draft_s, "draft_overhead_s": costs.draft_overhead_s}


def cached_draft(target: Backend, d: Draft, costs: CostModel, k_max: int) -> bool:
    """Add the draft's cost from this process's or the disk's cache: False if not there."""
    path = _draft_cache(target, d, k_max)
    data = _measured.get(str(path))
    if data is None and path.is_file():
        data = json.loads(path.read_text())
    if data is None:
        return False
    for name, table in _draft_tables(costs).items():
        table.update(data[name])
    return True


def measure_draft_cached(target: Backend, d: Draft, costs: CostModel, k_max: int) -> None:
    """measure_draft, cached beside the calibration: a draft loaded after start-up (a prefetch)
    is measured once per machine, not again by each fresh process while it decodes."""
    if cached_draft(target, d, costs, k_max):
        return
    path = _draft_cache(target, d, k_max)
    tables = _draft_tables(costs)
    with OthersLoad() as load:
        measure_draft(d, costs, k_max)
    entry = {name: {d.id: t[d.id]} if d.id in t else {} for name, t in tables.items()}
    _measured[str(path)] = entry
    if _cacheable(load.share, f"draft {d.id}"):
        _write_json(path, entry | {"measured_at": time.time()})


def calibrate(
    target: Backend, drafts: list[Draft], k_max: int, force: bool = False, extra: str = ""
) -> CostModel:
    """The target's verify (and batch) costs, cached per target file and machine, then each
    draft's, cached per draft (measure_draft_cached): a runtime with another set of drafts
    (a daemon preloading the whole family after `generate` named three) measures nothing
    again. On a 1.5B target on 2 cores the verify curve alone takes minutes."""
    costs = Calibration(target, k_max, force, extra).run(drafts)
    assert costs is not None  # never stopped: measured whole
    return costs


def _never() -> bool:
    return False


class Calibration:
    """One target's calibration, read from the caches where they hold it, else measured a
    timed pass at a time: `run` goes on where the last run stopped until it is done (the
    costs) or `stop()` says to stop between two passes (None). A Calibration that needs no
    measuring is `done` when made. The target curve's others' load is summed over every
    run's passes, and judged once (BUSY_SHARE) before it is cached."""

    def __init__(self, target: Backend, k_max: int, force: bool = False, extra: str = ""):
        self.target, self.k_max = target, k_max
        self._path = cache_dir() / f"calibration-{cache_key(target, [], k_max, extra)}.json"
        if force:  # drafts measured when they were loaded later are measured again too
            for old in cache_dir().glob(f"{DRAFT_CACHE_PREFIX}*.json"):
                old.unlink(missing_ok=True)
            _measured.clear()
        self.costs: CostModel | None = None if force else self._cached()
        self._passes: Generator[None, None, CostModel] | None = None
        self._others_s = self._wall_s = 0.0
        self.passes = 0  # timed passes run so far (status, tests)

    def _cached(self) -> CostModel | None:
        data = _measured.get(str(self._path))
        if data is None and self._path.is_file():
            data = json.loads(self._path.read_text())
        if data is None:
            return None
        costs = CostModel(list(data["verify_s"]))
        costs.batch_s = {int(n): s for n, s in data.get("batch_s", {}).items()}
        return costs

    def done(self, drafts: list[Draft]) -> CostModel | None:
        """The costs, if the caches hold the target's curve and every one of `drafts`."""
        costs = self.costs
        if costs is None:
            return None
        missing = [d for d in drafts if not cached_draft(self.target, d, costs, self.k_max)]
        return None if missing else costs

    def run(
        self,
        drafts: list[Draft],
        stop: Callable[[], bool] = _never,
        lock: AbstractContextManager[object] | None = None,
    ) -> CostModel | None:
        """Measure what is left, `lock` held over each pass: the target's curve, then each
        of `drafts` not measured yet (one pass each). None if `stop()` came first."""
        guard = lock if lock is not None else nullcontext()
        while self.costs is None:
            if stop():
                return None
            if self._passes is None:
                self._passes = target_passes(self.target, self.k_max)
            with guard, OthersLoad() as load:
                try:
                    next(self._passes)
                    finished = None
                except StopIteration as end:
                    finished = end.value
            self._others_s += load.others_s
            self._wall_s += load.wall_s
            if finished is None:
                self.passes += 1
            else:
                self._keep(finished)
        costs = self.costs
        for d in drafts:
            if cached_draft(self.target, d, costs, self.k_max):
                continue
            if stop():
                return None
            with guard:
                measure_draft_cached(self.target, d, costs, self.k_max)
            self.passes += 1
        return costs

    def _keep(self, costs: CostModel) -> None:
        """The target's measured curve: this process's, and the disk's if it was quiet."""
        self.costs, self._passes = costs, None
        entry = {"verify_s": list(costs.verify_s), "batch_s": dict(costs.batch_s)}
        _measured[str(self._path)] = entry
        share = others_share(self._others_s, self._wall_s)
        if _cacheable(share, "the verify curve"):
            _write_json(self._path, entry | {"measured_at": time.time(), "others_cpu": share})


def _cacheable(share: float, what: str) -> bool:
    if share <= BUSY_SHARE:
        return True
    log.warning(
        "calibration of %s ran while other processes took %.0f%% of the CPU: used by this "
        "process (reloads included), not cached on disk (measured again at the next start)",
        what,
        100 * share,
    )
    return False


def _write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
