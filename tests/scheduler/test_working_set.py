"""The working set on the real pool (prompt lookup + three llama.cpp drafts) and real target.

The budget holds the target plus about two model drafts, so loads must evict. Checked: the
modelled budget is never exceeded (sampled continuously from another thread, and the measured
RSS stays within it too); greedy output stays identical to plain decoding whatever is
resident; stalls are counted; a background load never blocks generation.
"""

from __future__ import annotations

import random
import threading
import time

import psutil
import pytest

from memspec.backends.base import BackendOptions
from memspec.config import Settings
from memspec.drafts.manifest import DEFAULT_MANIFEST_DIR, load_manifests
from memspec.engine.sampling import SamplingParams
from memspec.errors import BudgetExceeded, InvalidRequest
from memspec.memory.footprint import target_footprint
from memspec.paths import models_dir
from memspec.runtime import Runtime
from memspec.scheduler.manifest_source import ManifestSource
from memspec.scheduler.working_set import DraftState

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

TARGET_FILE = "smollm2-135m-f32.gguf"
N_CTX = 512
MODELS = ["q8_0", "q4_0", "q2_k"]
MAX_TOKENS = 12
PROMPTS = [
    "Extract the names from this sentence: Alice met Bob and Carol at the station, "
    "then Alice and Carol took the train.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


class Monitor:
    """Samples modelled use and process RSS every few ms; records the worst seen."""

    def __init__(self, rt: Runtime, rss_base: int):
        self.rt, self.rss_base = rt, rss_base
        self.worst_over = -(10**12)  # max(used - budget) seen
        self.worst_rss = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        proc = psutil.Process()
        ws = self.rt.working_set
        while not self._stop.is_set():
            self.worst_over = max(self.worst_over, ws.used_bytes() - ws.budget_bytes)
            self.worst_rss = max(self.worst_rss, proc.memory_info().rss - self.rss_base)
            time.sleep(0.003)

    def __enter__(self) -> Monitor:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


@pytest.fixture(scope="module")
def setup():
    target = models_dir() / TARGET_FILE
    if not target.is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)
    rss_base = psutil.Process().memory_info().rss
    reserved = target_footprint(target, N_CTX, 8).total
    # Sized from the model itself: the target plus the two smaller drafts, and a little.
    source = ManifestSource(load_manifests(DEFAULT_MANIFEST_DIR), BackendOptions(n_ctx=N_CTX), "")
    sizes = {d: source.draft_bytes(d) for d in MODELS}
    budget = reserved + sizes["q4_0"] + sizes["q2_k"] + 8_000_000
    rt = Runtime(
        Settings.load(drafts=["prompt-lookup", "q2_k"], n_ctx=N_CTX, budget=budget, n_threads=1),
        calibrate_costs=False,
    )
    prompts = [
        rt.requests.prompt_tokens(messages=[{"role": "user", "content": p}]) for p in PROMPTS
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    refs = [rt.generate(p, params, draft="none").token_ids for p in prompts]
    yield rt, prompts, refs, sizes, rss_base
    rt.close()


def reset(rt: Runtime) -> None:
    ws = rt.working_set
    for row in ws.status():
        if row["pinned"]:
            ws.unpin(row["id"])
    ws.prefetch([])


def test_budget_never_exceeded_randomized(setup):
    """Random prefetches, acquires, pins, evictions and requests, with a second thread
    generating all along, so evictions hit drafts the engine is using."""
    rt, prompts, refs, sizes, rss_base = setup
    ws = rt.working_set
    reset(rt)
    rng = random.Random(1234)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    errors: list[str] = []
    stop = threading.Event()
    done = [0]

    def generator() -> None:  # requests keep coming while the working set changes
        i = 0
        while not stop.is_set():
            j = i % len(prompts)
            draft = rng_g.choice(["auto", "auto", *MODELS])
            try:
                gen = rt.generate(prompts[j], params, draft=draft)
            except BudgetExceeded:
                continue  # a named draft that cannot fit beside the pinned one: refused
            if gen.token_ids != refs[j]:
                errors.append(f"{draft} diverged on prompt {j}")
            done[0] += 1
            i += 1

    rng_g = random.Random(99)
    with Monitor(rt, rss_base) as mon:
        t = threading.Thread(target=generator, daemon=True)
        t.start()
        pinned: str | None = None
        for _ in range(40):
            op = rng.choice(["prefetch", "prefetch", "acquire", "acquire_nowait", "pin", "evict"])
            d = rng.choice(MODELS)
            try:
                if op == "prefetch":
                    wanted = [(m, rng.random()) for m in rng.sample(MODELS, rng.randint(1, 3))]
                    ws.prefetch(wanted)
                elif op == "acquire":
                    assert ws.acquire(d) is not None
                    assert d in ws.resident_ids()
                elif op == "acquire_nowait":
                    ws.acquire(d, wait=False)
                elif op == "pin":
                    if pinned is not None:
                        rt.draft_admin.pin(pinned, False)
                        pinned = None
                    else:
                        rt.draft_admin.pin(d)
                        pinned = d
                        assert ws.state(d) == DraftState.RESIDENT
                elif op == "evict":
                    if d == pinned:
                        with pytest.raises(InvalidRequest):
                            rt.draft_admin.evict_draft(d)
                    else:
                        rt.draft_admin.evict_draft(d)
            except BudgetExceeded:
                assert pinned is not None  # only pinned drafts may block a load (not in-use)
            ws.release_leases()
            assert ws.used_bytes() <= ws.budget_bytes
            time.sleep(rng.random() * 0.05)
        ws.wait_idle(timeout=60)
        stop.set()
        t.join(timeout=120)
    assert not errors, errors
    assert done[0] >= 3, "the generator thread made no progress"
    assert mon.worst_over <= 0, f"modelled use went {mon.worst_over} bytes over the budget"
    assert ws.peak_bytes <= ws.budget_bytes
    assert ws.loads >= 5 and ws.evictions >= 3, ws.summary()
    # Measured: what the process grew by never went over the budget (the model is within a
    # few percent of RSS; 10% leaves room for allocator slack after many loads and frees).
    assert mon.worst_rss <= ws.budget_bytes * 1.10, (mon.worst_rss, ws.budget_bytes)
    if pinned is not None:
        rt.draft_admin.pin(pinned, False)
    print(ws.summary(), f"worst RSS growth {mon.worst_rss / 1e6:.0f} MB")


def test_pinned_drafts_block_loads_and_budget_changes(setup):
    rt, prompts, refs, sizes, _ = setup
    ws = rt.working_set
    reset(rt)
    # Evicts what it must: the budget holds q8_0 and no other model draft.
    rt.draft_admin.pin("q8_0")
    try:
        assert "q8_0" in ws.resident_ids()
        # q4_0 cannot fit beside the pinned q8_0: refused, never over budget.
        with pytest.raises(BudgetExceeded):
            ws.acquire("q4_0")
        with pytest.raises(BudgetExceeded):
            rt.generate(prompts[0], SamplingParams(max_tokens=4), draft="q2_k")
        with pytest.raises(BudgetExceeded):
            ws.budget_bytes = ws.reserved_bytes + sizes["q8_0"] - 1
        assert ws.used_bytes() <= ws.budget_bytes
        # Unpinned, it is an ordinary victim again.
        rt.draft_admin.pin("q8_0", False)
        assert ws.acquire("q4_0") is not None and "q8_0" not in ws.resident_ids()
    finally:
        rt.draft_admin.pin("q8_0", False)
    # Shrinking the budget live evicts by value per byte until it fits.
    old = ws.budget_bytes
    ws.prefetch([("q8_0", 1.0), ("q4_0", 5.0)])
    ws.budget_bytes = ws.reserved_bytes + sizes["q4_0"] + 1_000_000
    try:
        assert ws.used_bytes() <= ws.budget_bytes
        assert ws.resident_ids() & set(MODELS) <= {"q4_0"}
    finally:
        ws.budget_bytes = old


def test_stall_is_accounted(setup):
    rt, prompts, refs, sizes, _ = setup
    ws = rt.working_set
    reset(rt)
    for d in MODELS:
        rt.draft_admin.evict_draft(d)
    assert ws.acquire("q2_k", wait=False) is None  # schedules, does not wait
    stall0 = ws.stall_s
    ws.wait_idle(timeout=60)
    assert ws.stall_s == stall0 and "q2_k" in ws.resident_ids()
    # A request naming a draft that is not resident waits for its load: that is stall.
    rt.draft_admin.evict_draft("q4_0")
    gen = rt.generate(prompts[1], SamplingParams(max_tokens=MAX_TOKENS), draft="q4_0")
    assert gen.token_ids == refs[1]
    load_s = next(r["load_s"] for r in ws.status() if r["id"] == "q4_0")
    assert gen.stall_s >= 0.8 * load_s > 0
    assert ws.stall_s - stall0 == pytest.approx(gen.stall_s, rel=0.05, abs=1e-3)
    assert "q4_0" in gen.drafts_used
    # Resident now: no stall.
    gen = rt.generate(prompts[1], SamplingParams(max_tokens=MAX_TOKENS), draft="q4_0")
    assert gen.stall_s == 0.0


def test_background_prefetch_does_not_block_generate(setup):
    rt, prompts, refs, sizes, _ = setup
    ws = rt.working_set
    reset(rt)
    rt.draft_admin.evict_draft("q8_0")
    states: list[str] = []

    def on_token(_delta: str, _tok: int | None) -> None:
        states.append(ws.state("q8_0").value)

    # Fault injected on purpose: a slow disk. The load takes at least 2 s more than usual.
    real_hook = ws.on_loaded

    def slow_load(draft) -> None:
        time.sleep(2.0)
        if real_hook is not None:
            real_hook(draft)

    ws.on_loaded = slow_load
    try:
        ws.prefetch([("q8_0", 10.0)])  # the loader starts on it at once
        t0 = time.perf_counter()
        # The bare rule: memspec (the default policy) would replan what the set holds.
        gen = rt.generate(
            prompts[0],
            SamplingParams(max_tokens=MAX_TOKENS),
            draft="auto",
            policy="auto",
            on_token=on_token,
        )
        ws.wait_idle(timeout=60)
    finally:
        ws.on_loaded = real_hook
    assert gen.token_ids == refs[0]
    assert gen.stall_s == 0.0
    # Decoding went on while q8_0 was loading: tokens came out before it was resident.
    assert states and states[0] in ("absent", "loading"), states
    assert time.perf_counter() - t0 >= 2.0  # the slow load really was in progress
    assert "q8_0" in ws.resident_ids()


def test_status_rows_and_runtime_api(setup):
    rt, *_ = setup
    rows = {r["id"]: r for r in rt.draft_admin.draft_status()}
    assert {"prompt-lookup", *MODELS} <= set(rows)
    for r in rows.values():
        assert {
            "id",
            "kind",
            "bytes",
            "resident",
            "pinned",
            "acceptance",
            "requests",
            "tags",
        } <= set(r)
        assert r["state"] in {s.value for s in DraftState}
        assert r["resident"] == (r["state"] == "resident")
    assert rows["prompt-lookup"]["bytes"] == 0 and rows["q8_0"]["bytes"] > rows["q2_k"]["bytes"]
    assert rows["q8_0"]["bytes"] == rt.draft_admin.draft_bytes("q8_0")
    assert rt.modelled_bytes() == rt.working_set.used_bytes() <= rt.settings.budget_bytes
    mem = rt.memory_status()
    assert mem["budget_bytes"] == rt.settings.budget_bytes and mem["shedding"] in (
        "none",
        "evicted drafts",
        "no model draft resident",
    )


def test_a_self_draft_is_known_to_share_the_target_kv_before_it_loads(setup):
    """The policy weighs a prefetch before the load: the header says what the loaded draft
    will do (copy the target's KV cache), and the loaded draft agrees."""
    rt, *_ = setup
    ws = rt.working_set
    reset(rt)
    if "q8_0" in ws.resident_ids():  # an earlier test's load
        ws.evict("q8_0")
    ws.wait_idle(timeout=30)
    rows = {r["id"]: r for r in ws.status()}
    assert rows["q8_0"]["state"] == "absent"
    assert rows["q8_0"]["shares_target_kv"]  # the target's own quantization
    assert not rows["prompt-lookup"]["shares_target_kv"]  # nothing to copy into
    ws.load("q8_0")
    ws.wait_idle(timeout=60)
    loaded = {r["id"]: r for r in ws.status()}["q8_0"]
    assert loaded["state"] == "resident" and loaded["shares_target_kv"]
    assert rt.drafts["q8_0"].kv_donor is rt.target
