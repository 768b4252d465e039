"""Device profiles for the simulator: memory, load bandwidth and per-token costs, as TOML files.

A profile says what things cost on a device; a trace says what the drafts accept. The
simulator combines the two. Profiles live in memspec_lab/sim/profiles/NAME.toml; `this-machine`
is written by `memspec sim calibrate` from measurements, others are written by hand with the
source of every number next to it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from memspec.compat import tomllib
from memspec.engine.costs import CostModel

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass
class DraftCost:
    bytes: int
    s_per_token: float = 0.0  # one draft decode step (model drafts)
    prefill_s_per_token: float = 0.0  # batched catch-up on context it has not seen
    overhead_s: float = 0.0  # per round (lookup-style proposers)
    kv_copy_s: float | None = None  # a self-draft's catch-up by copying the target's KV cache
    load_s: float | None = None  # measured; None: from the load bandwidth


@dataclass
class Profile:
    name: str
    memory_bytes: int
    usable_bytes: int
    load_bandwidth: float  # bytes/s from storage into model memory
    load_overhead_s: float  # fixed cost of one load (open, allocate, init)
    load_contention: float  # decode slowdown while a background load runs (0.1 = 10%)
    target_bytes: int  # target weights + its KV cache + scratch
    target_prefill_s_per_token: float
    verify_s: list[float]  # target forward of a batch of b = 1..k_max+1 tokens
    round_overhead_s: float  # engine work per round outside forward passes
    drafts: dict[str, DraftCost] = field(default_factory=dict)
    # Drafts the profile does not list: cost from their size (memory-bound decoding).
    default_s_per_token: float = 0.0
    default_s_per_byte: float = 0.0
    default_overhead_s: float = 0.0  # per round, for proposer kinds (lookup, datastore...)
    source: str = ""

    def draft(self, draft_id: str, bytes_hint: int = 0, kind: str = "model") -> DraftCost:
        if draft_id in self.drafts:
            return self.drafts[draft_id]
        if kind not in ("model", "head"):  # lookups: a cost per round
            return DraftCost(bytes=bytes_hint, overhead_s=self.default_overhead_s)
        per_token = self.default_s_per_token + self.default_s_per_byte * bytes_hint
        return DraftCost(bytes=bytes_hint, s_per_token=per_token, prefill_s_per_token=per_token / 8)

    def load_s(self, cost: DraftCost) -> float:
        if cost.bytes == 0:
            return 0.0
        if cost.load_s is not None:
            return cost.load_s
        return self.load_overhead_s + cost.bytes / self.load_bandwidth

    def cost_model(self, drafts: dict[str, DraftCost]) -> CostModel:
        return CostModel(
            verify_s=[v + self.round_overhead_s for v in self.verify_s],
            draft_s={d: c.s_per_token for d, c in drafts.items() if c.s_per_token},
            draft_overhead_s={d: c.overhead_s for d, c in drafts.items() if c.overhead_s},
        )


def profile_from_trace(trace) -> Profile:
    """This machine as the trace measured it while collecting (`--profile trace`): the
    calibrated verify/draft costs, median real load times, prefill rates, and the engine's
    per-round overhead (plain rounds' wall time minus the calibrated single-token verify)."""
    h = trace.header
    costs = h["costs"]

    def median(xs: list[float], default: float = 0.0) -> float:
        return statistics.median(xs) if xs else default

    def timing(key: str) -> list[float]:
        return [r.timing[key] for r in trace.requests if key in r.timing]

    plain = [x.draft_s + x.verify_s for r in trace.requests for x in r.plain.rounds]
    drafts = {}
    for d, info in h["drafts"].items():
        if info["kind"] == "model":
            drafts[d] = DraftCost(
                bytes=int(info["bytes"]),
                s_per_token=float(costs["draft_s"].get(d, 0.0)),
                prefill_s_per_token=median(timing(f"prefill_s_per_token/{d}")),
                load_s=float(info.get("load_s_median", 0.0)),
                kv_copy_s=(
                    median(timing(f"kv_copy_s/{d}")) if info.get("shares_target_kv") else None
                ),
            )
        elif info["kind"] == "head":  # per token, nothing to catch up
            drafts[d] = DraftCost(
                bytes=int(info["bytes"]),
                s_per_token=float(costs["draft_s"].get(d, 0.0)),
                load_s=float(info.get("load_s_median", 0.0)),
            )
        else:
            drafts[d] = DraftCost(
                bytes=int(info["bytes"]),
                overhead_s=float(costs["draft_overhead_s"].get(d, 0.0)),
                load_s=float(info.get("load_s_median", 0.0)),
            )
    return Profile(
        name="trace",
        memory_bytes=0,
        usable_bytes=0,
        load_bandwidth=1e9,
        load_overhead_s=0.0,
        load_contention=0.0,
        target_bytes=int(h["target"]["bytes"]),
        target_prefill_s_per_token=median(timing("prefill_s_per_token/target")),
        verify_s=[float(x) for x in costs["verify_s"]],
        round_overhead_s=max(median(plain, costs["verify_s"][0]) - costs["verify_s"][0], 0.0),
        drafts=drafts,
        source="trace header and timings",
    )


def profile_for(name_or_path: str, trace=None) -> Profile:
    """A named/file profile, or "trace": the costs the trace itself measured."""
    if name_or_path == "trace":
        if trace is None:
            raise ValueError("profile 'trace' needs a trace")
        return profile_from_trace(trace)
    return load_profile(name_or_path)


def resolve_profile(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.is_file():
        return p
    cand = PROFILE_DIR / f"{name_or_path}.toml"
    if cand.is_file():
        return cand
    known = ", ".join(sorted(x.stem for x in PROFILE_DIR.glob("*.toml")))
    hint = " (run `memspec sim calibrate`)" if name_or_path == "this-machine" else ""
    raise FileNotFoundError(f"no device profile {name_or_path!r}{hint}; known: {known}")


def load_profile(name_or_path: str) -> Profile:
    path = resolve_profile(name_or_path)
    try:
        d = tomllib.loads(path.read_text())
        mem, load, target = d["memory"], d["load"], d["target"]
        drafts = {k: DraftCost(**v) for k, v in d.get("drafts", {}).items()}
        default = d.get("draft_default", {})
        return Profile(
            name=d.get("name", path.stem),
            memory_bytes=int(mem["total_bytes"]),
            usable_bytes=int(mem["usable_bytes"]),
            load_bandwidth=float(load["bandwidth_bytes_per_s"]),
            load_overhead_s=float(load.get("overhead_s", 0.0)),
            load_contention=float(load.get("contention", 0.0)),
            target_bytes=int(target["bytes"]),
            target_prefill_s_per_token=float(target["prefill_s_per_token"]),
            verify_s=[float(x) for x in target["verify_s"]],
            round_overhead_s=float(target.get("round_overhead_s", 0.0)),
            drafts=drafts,
            default_s_per_token=float(default.get("s_per_token", 0.0)),
            default_s_per_byte=float(default.get("s_per_byte", 0.0)),
            default_overhead_s=float(default.get("overhead_s", 0.0)),
            source=str(path),
        )
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: bad device profile: {e!r}") from e


# --- this machine -------------------------------------------------------------------------


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_contention(rt, ctx: list[int], reps: int = 15) -> float:
    """How much slower a decode step is while a draft loads in another thread (0.1 = 10%)."""
    import threading

    from memspec.drafts.registry import instantiate

    models = [d for d in rt.manifests.values() if d.kind == "model" and d.id in rt.drafts]
    if not models:
        return 0.0
    be = rt.target
    be.reset()
    be.eval(ctx[:128], all_logits=False)

    def step() -> None:
        be.eval([ctx[0]], all_logits=False)
        be.truncate(128)

    idle = _median_time(step, reps)
    stop = threading.Event()

    private = replace(rt.options, share_weights=False)  # real loads, never joined

    def loader() -> None:
        while not stop.is_set():
            instantiate(models[0], private, rt.settings.backend).close()

    th = threading.Thread(target=loader, daemon=True)
    th.start()
    try:
        busy = _median_time(step, reps)
    finally:
        stop.set()
        th.join()
    be.reset()
    return max(busy / idle - 1.0, 0.0)


def measure_this_machine(settings, load_reps: int = 5) -> dict:
    """Measure what the simulator needs on this machine, on the real models."""
    import numpy as np
    import psutil

    from memspec.drafts.model import ModelDraft
    from memspec.engine.calibration import calibrate
    from memspec.engine.policy import FixedPolicy
    from memspec.engine.sampling import SamplingParams
    from memspec.engine.speculative import speculative_generate
    from memspec.runtime import Runtime
    from memspec_lab.sim.traces import footprints, measure_loads

    rt = Runtime(settings, calibrate_costs=False)
    try:
        costs = calibrate(rt.target, list(rt.drafts.values()), settings.k_max, force=True)
        rng = np.random.default_rng(0)
        ctx = [int(t) for t in rng.integers(100, 10000, size=256)]

        def prefill(be) -> float:
            def run() -> None:
                be.reset()
                be.eval(ctx, all_logits=False)

            return _median_time(run, 3) / len(ctx)

        target_prefill = prefill(rt.target)
        # Engine overhead per round: a plain greedy decode, minus its forward passes.
        prompt = rt.requests.prompt_tokens(
            messages=[{"role": "user", "content": "Tell me about Paris."}]
        )
        rt.target.reset()
        f0 = rt.target.forward_s
        gen = speculative_generate(
            rt.target, prompt, SamplingParams(max_tokens=48), FixedPolicy(None, 0)
        )
        overhead = max(gen.elapsed_s - (rt.target.forward_s - f0), 0.0) / max(gen.rounds, 1)
        loads = measure_loads(rt, list(rt.drafts), load_reps)
        contention = measure_contention(rt, ctx)
        target_bytes, sizes = footprints(rt, list(rt.drafts))
        drafts = {}
        for d, draft in rt.drafts.items():
            entry = {"bytes": sizes[d]}
            if isinstance(draft, ModelDraft):
                entry["s_per_token"] = costs.draft_s[d]
                entry["prefill_s_per_token"] = prefill(draft.backend)
                entry["load_s"] = statistics.median(loads[d])
            else:
                entry["overhead_s"] = costs.draft_overhead_s.get(d, 0.0)
            drafts[d] = entry
        # Load bandwidth: bytes over seconds of the model drafts' real loads.
        sized = [(drafts[d]["bytes"], drafts[d]["load_s"]) for d in drafts if "load_s" in drafts[d]]
        bandwidth = sum(b for b, _ in sized) / max(sum(s for _, s in sized), 1e-9) if sized else 1e9
        vm = psutil.virtual_memory()
        return {
            "memory": {"total_bytes": vm.total, "usable_bytes": vm.available},
            "load": {
                "bandwidth_bytes_per_s": bandwidth,
                "overhead_s": 0.0,
                "contention": contention,
            },
            "target": {
                "bytes": target_bytes,
                "prefill_s_per_token": target_prefill,
                "verify_s": costs.verify_s,
                "round_overhead_s": overhead,
            },
            "drafts": drafts,
            "settings": {
                "target": settings.target,
                "n_ctx": settings.n_ctx,
                "n_threads": settings.n_threads,
                "k_max": settings.k_max,
            },
        }
    finally:
        rt.close()


def write_this_machine(m: dict, out: Path) -> Path:
    """The measured profile as TOML, each number with where it came from."""
    import os
    import platform

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    src = (
        f"measured by `memspec sim calibrate` on {platform.node()} ({os.cpu_count()} cores), {when}"
    )
    t, ld = m["target"], m["load"]
    lines = [
        f"# Device profile of this machine. {src}.",
        f"# Models: target {m['settings']['target']}, n_ctx {m['settings']['n_ctx']}, "
        f"n_threads {m['settings']['n_threads']}, k_max {m['settings']['k_max']}.",
        'name = "this-machine"',
        "",
        "[memory]",
        f"total_bytes = {m['memory']['total_bytes']}  # psutil.virtual_memory().total",
        f"usable_bytes = {m['memory']['usable_bytes']}  # psutil available at calibration time",
        "",
        "[load]",
        f"bandwidth_bytes_per_s = {ld['bandwidth_bytes_per_s']:.0f}  "
        "# sum(draft bytes) / sum(median real load s), llama.cpp with mmap off",
        "overhead_s = 0.0  # folded into each draft's measured load_s below",
        f"contention = {ld['contention']:.4g}  "
        "# median decode step with a draft loading in another thread / without, - 1",
        "",
        "[target]",
        f"bytes = {t['bytes']}  # footprint model: weights, KV, buffers, scratch",
        f"prefill_s_per_token = {t['prefill_s_per_token']:.6g}  # median, 3 prefills of 256 tokens",
        "verify_s = ["
        + ", ".join(f"{x:.6g}" for x in t["verify_s"])
        + "]  # engine calibration: median of 7 batches of 1..k_max+1 at 128 context",
        f"round_overhead_s = {t['round_overhead_s']:.6g}  "
        "# (wall - forward time) / rounds of a 48-token plain decode",
        "",
        "[draft_default]",
        "s_per_token = 0.0  # drafts not listed: unknown on this machine; calibrate with them",
        "s_per_byte = 0.0",
        "overhead_s = 0.0",
    ]
    for d, e in m["drafts"].items():
        lines += ["", f'[drafts."{d}"]', f"bytes = {e['bytes']}  # footprint model (memspec plan)"]
        if "s_per_token" in e:
            lines += [
                f"s_per_token = {e['s_per_token']:.6g}  # engine calibration, median of 7",
                f"prefill_s_per_token = {e['prefill_s_per_token']:.6g}  # median of 3 x 256 tokens",
                f"load_s = {e['load_s']:.6g}  # median of real loads (instantiate, mmap off)",
            ]
        else:
            lines.append(f"overhead_s = {e['overhead_s']:.6g}  # one proposal on 512 tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def calibrate_this_machine(settings, out: Path | None = None, load_reps: int = 5) -> Path:
    return write_this_machine(
        measure_this_machine(settings, load_reps), out or PROFILE_DIR / "this-machine.toml"
    )
