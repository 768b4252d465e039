"""What fits in a memory budget: resident drafts, eviction order, the lower bound, what to shed.

The budget covers everything the daemon allocates for models: the target (charged first) and
its KV cache and buffers, then the drafts. When everything does not fit, SpecMemo's order of
shedding applies, cheapest loss first:
  1. evict drafts     (lowest value per byte first; keep the best set that fits)
  2. shorten k        (fewer logit rows per verification: the candidate buffers)
  3. shorten n_ctx    (smaller KV caches and attention scratch, for target and draft)
  4. plain decoding   (no model draft; weightless drafts such as prompt lookup still run)
The lower bound that still speculates is target + the smallest model draft at k = 1.

`n_ctx = "auto"` (plan_context) turns the order round for the context: the drafts that fit
beside a context of AUTO_FLOOR_N_CTX are kept, and the context per slot is what is left, up to
the model's trained context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memspec.drafts.gguf_header import open_header, scalar
from memspec.drafts.manifest import DraftManifest
from memspec.errors import ModelLoadError
from memspec.kv_cache import F16, KV_TYPES, KVCache
from memspec.memory.fill import density, fill_by_value
from memspec.memory.footprint import KV_PAD, Footprint, draft_footprint, target_footprint
from memspec.units import format_size

SHED_STEPS = ("evict drafts", "shorten k", "shorten n_ctx", "plain decoding")
MIN_N_CTX = 256
# Sequence slots `parallel = 0` (auto) gives at most: past about 8 on a small CPU a batch
# costs nearly its tokens' worth of single steps, and each slot holds a KV cache.
AUTO_MAX_SLOTS = 8
# n_ctx = "auto" keeps the drafts that fit beside a context this long (or the trained context,
# if shorter); the context per slot then takes everything they leave.
AUTO_FLOOR_N_CTX = 2048


def slots_that_fit(
    budget_bytes: int,
    target_path: Path,
    n_ctx: int,
    k: int,
    reserved_bytes: int = 0,
    n_gpu_layers: int = 0,
    cap: int = AUTO_MAX_SLOTS,
    kv_cache: KVCache = F16,
) -> int:
    """The most sequence slots (1..cap) whose target footprint, with `reserved_bytes` beside
    it (resident drafts), fits the budget; 1 when even two do not."""
    best = 1
    for slots in range(2, cap + 1):
        fp = target_footprint(target_path, n_ctx, k, n_gpu_layers, slots, kv_cache)
        if fp.total + reserved_bytes > budget_bytes:
            break
        best = slots
    return best


def longest_context(
    budget_bytes: int,
    target_path: Path,
    k: int,
    reserved_at: Callable[[int], int] = lambda n: 0,
    n_gpu_layers: int = 0,
    slots: int = 1,
    kv_cache: KVCache = F16,
    limit: int = 1 << 20,
) -> int:
    """The longest context per slot (in llama.cpp's 256-cell steps, up to `limit`) whose target
    footprint, beside `reserved_at(n_ctx)` (the drafts kept resident, whose own contexts grow
    with it), fits the budget; 0 when not even MIN_N_CTX does. SpecMemo's order: the drafts
    that pay are kept, and context is what is left."""

    def fits(n: int) -> bool:
        fp = target_footprint(target_path, n, k, n_gpu_layers, slots, kv_cache)
        return fp.total + reserved_at(n) <= budget_bytes

    if not fits(MIN_N_CTX):
        return 0
    lo, hi = MIN_N_CTX // KV_PAD, max(limit // KV_PAD, MIN_N_CTX // KV_PAD)
    while lo < hi:  # the footprint grows with n_ctx: bisect on 256-cell steps
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * KV_PAD) else (lo, mid - 1)
    return lo * KV_PAD


def trained_context(path: Path) -> int:
    """The context the model was trained for (`<arch>.context_length`): no plan goes beyond
    it, whatever the budget would hold."""
    reader = open_header(path)
    arch = scalar(reader, "general.architecture") or "llama"
    return int(scalar(reader, f"{arch}.context_length") or 1 << 20)


@dataclass
class ContextPlan:
    """The context per slot against the drafts resident and the slots: `n_ctx = "auto"`
    resolved (or a fixed n_ctx, with what auto would give beside it), for `memspec plan`, the
    runtime and its status."""

    n_ctx: int  # per slot; 0: not even MIN_N_CTX fits beside the target
    auto: bool  # resolved from "auto" (else the configured n_ctx)
    slots: int
    drafts: list[str]  # planned resident beside it (those that fit, in preload order)
    drafts_bytes: int  # their footprint at n_ctx
    target_bytes: int  # the target's at n_ctx with its slots (KV, rows, scratch)
    budget_bytes: int
    trained: int  # the model's trained context: no plan goes beyond it
    longest: int  # the longest context per slot beside `drafts` at these slots (auto: n_ctx)
    without_drafts: int  # the same with no draft resident: what the drafts cost in context
    left_out: list[str] = field(default_factory=list)  # preloaded drafts that do not fit

    @property
    def limited_by(self) -> str:
        return "trained context" if self.longest >= self.trained // KV_PAD * KV_PAD else "budget"

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_ctx": self.n_ctx,
            "auto": self.auto,
            "slots": self.slots,
            "drafts": self.drafts,
            "drafts_bytes": self.drafts_bytes,
            "target_bytes": self.target_bytes,
            "budget_bytes": self.budget_bytes,
            "trained_context": self.trained,
            "longest": self.longest,
            "limited_by": self.limited_by,
            "without_drafts": self.without_drafts,
            "left_out": self.left_out,
        }

    def describe(self) -> str:
        """One line: "7,936 tokens per slot x 1 slot beside prompt-lookup, q4_0 (...)"."""
        drafts = ", ".join(self.drafts) or "no draft"
        where = "auto, " if self.auto else ""
        text = (
            f"{self.n_ctx:,} tokens per slot x {self.slots} slot{'s' if self.slots > 1 else ''}"
            f" beside {drafts} ({where}limit: {self.limited_by}, trained {self.trained:,}"
        )
        if not self.auto:
            text += f"; auto would give {self.longest:,}"
        return text + f"; {self.without_drafts:,} with no draft)"


def plan_context(
    budget_bytes: int,
    target_path: Path,
    k: int,
    drafts_at: Callable[[int], list[DraftFit]],
    n_ctx: int | str = "auto",
    parallel: int = 0,
    n_gpu_layers: int = 0,
    kv_cache: KVCache = F16,
    cap: int = AUTO_MAX_SLOTS,
) -> ContextPlan:
    """The context per slot and the slots under `budget_bytes`, beside the drafts of
    `drafts_at(n_ctx)` (their footprints at that context, in preload order; drafts' caches
    grow with the context too). `parallel`: the slots (0: as many as fit, at most `cap`).

    n_ctx "auto": the drafts that fit beside the target at AUTO_FLOOR_N_CTX (or the trained
    context, if shorter) are kept, in order, each one that fits; the context per slot is then
    the longest that fits beside them, at most the trained context; with parallel 0 the slots
    are then as many as fit at that context (more than one only where the trained context
    caps it). A fixed n_ctx: the slots as before (parallel, or as many as fit beside every
    preloaded draft), and the drafts that fit beside it."""
    trained = trained_context(target_path)

    def target(n: int, slots: int) -> int:
        return target_footprint(target_path, n, k, n_gpu_layers, slots, kv_cache).total

    def first_fit(n: int, slots: int) -> tuple[list[str], list[str]]:
        room = budget_bytes - target(n, slots)
        kept, out = [], []
        for d in drafts_at(n):
            if d.footprint is None:
                continue
            if d.bytes <= room:
                kept.append(d.id)
                room -= d.bytes
            else:
                out.append(d.id)
        return kept, out

    def bytes_at(ids: list[str]) -> Callable[[int], int]:
        return lambda n: sum(d.bytes for d in drafts_at(n) if d.id in ids)

    auto = n_ctx == "auto"
    if auto:
        floor = max(MIN_N_CTX, min(AUTO_FLOOR_N_CTX, trained // KV_PAD * KV_PAD))
        kept, left_out = first_fit(floor, parallel or 1)
        reserved = bytes_at(kept)
        n = longest_context(
            budget_bytes, target_path, k, reserved, n_gpu_layers, parallel or 1, kv_cache, trained
        )
        slots = parallel or 1
        if not parallel and n >= trained // KV_PAD * KV_PAD:  # capped: room for more slots
            slots = slots_that_fit(
                budget_bytes, target_path, n, k, reserved(n), n_gpu_layers, cap, kv_cache
            )
        longest = n
    else:
        n = int(n_ctx)
        every = sum(d.bytes for d in drafts_at(n))
        slots = parallel or slots_that_fit(
            budget_bytes, target_path, n, k, every, n_gpu_layers, cap, kv_cache
        )
        kept, left_out = first_fit(n, slots)
        reserved = bytes_at(kept)
        longest = longest_context(
            budget_bytes, target_path, k, reserved, n_gpu_layers, slots, kv_cache, trained
        )
    without = longest_context(
        budget_bytes, target_path, k, n_gpu_layers=n_gpu_layers, slots=slots, kv_cache=kv_cache,
        limit=trained,
    )  # fmt: skip
    at = n or MIN_N_CTX
    return ContextPlan(
        n_ctx=n,
        auto=auto,
        slots=slots,
        drafts=kept,
        drafts_bytes=reserved(at),
        target_bytes=target(at, slots),
        budget_bytes=budget_bytes,
        trained=trained,
        longest=longest,
        without_drafts=without,
        left_out=left_out,
    )


def least_target_bytes(
    target_path: Path,
    k: int,
    n_gpu_layers: int = 0,
    slots: int = 1,
    kv_cache: KVCache = F16,
) -> int:
    """What the target needs at the shortest context n_ctx "auto" gives (MIN_N_CTX)."""
    return target_footprint(target_path, MIN_N_CTX, k, n_gpu_layers, slots, kv_cache).total


def fit_hint(
    budget_bytes: int,
    target_path: Path,
    k: int,
    n_gpu_layers: int = 0,
    slots: int = 1,
    kv_cache: KVCache = F16,
) -> str:
    """What a refused n_ctx is told: the longest context per slot the target alone fits in
    this budget, or the budget the shortest context needs."""
    n = longest_context(
        budget_bytes, target_path, k, n_gpu_layers=n_gpu_layers, slots=slots, kv_cache=kv_cache,
        limit=trained_context(target_path),
    )  # fmt: skip
    per = f" with {slots} slots" if slots > 1 else ""
    if n:
        return (
            f"the longest n_ctx that fits this budget{per} is {n} tokens per slot, the target "
            "alone (n_ctx = auto sizes it beside the drafts)"
        )
    least = target_footprint(target_path, MIN_N_CTX, k, n_gpu_layers, slots, kv_cache).total
    return f"even n_ctx {MIN_N_CTX}{per} needs {format_size(least)}"


@dataclass
class DraftFit:
    id: str
    kind: str
    footprint: Footprint | None  # None: its file is missing or unreadable
    value: float
    error: str | None = None

    @property
    def bytes(self) -> int:
        return self.footprint.total if self.footprint else 0

    @property
    def value_per_byte(self) -> float:
        return density(self.value, self.bytes)


@dataclass
class Plan:
    budget_bytes: int
    n_ctx: int  # requested (for "auto": what it resolved to, `context` says how)
    k_max: int  # requested
    kv_cache: KVCache  # the target's cache types (drafts' footprints carry their own)
    target: Footprint
    drafts: list[DraftFit]
    everything_bytes: int  # target + every available draft at (n_ctx, k_max)
    lower_bound_bytes: int | None  # target at k = 1 + the smallest model draft, at n_ctx
    lower_bound_draft: str | None
    target_only_bytes: int  # plain decoding at n_ctx
    # The outcome: what runs under this budget.
    fits: bool = False
    shed: list[str] = field(default_factory=list)  # empty: nothing to shed
    resident: list[str] = field(default_factory=list)
    evict_order: list[str] = field(default_factory=list)  # from everything resident
    k: int = 0
    planned_n_ctx: int = 0
    used_bytes: int = 0
    slots: int = 1  # sequence slots (batched decoding) that fit beside the plan's residents
    slot_bytes: int = 0  # what one more slot adds (its KV cache and logit rows)
    # The trade (`memspec plan`): the longest context per slot beside the plan's residents,
    # by KV cache type and slot count: {"f16": {1: 30720, 2: 15104}, ...}.
    context_by_kv: dict[str, dict[int, int]] = field(default_factory=dict)
    # n_ctx = "auto": how it was resolved (the drafts kept, the context left, the trade).
    context: ContextPlan | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "n_ctx": self.n_ctx,
            "k_max": self.k_max,
            "kv_cache": {
                "type_k": self.kv_cache.type_k,
                "type_v": self.kv_cache.type_v,
                "flash_attn": self.kv_cache.flash_attn,
            },
            "fits": self.fits,
            "shed": self.shed or ["none"],
            "resident": self.resident,
            "evict_order": self.evict_order,
            "k": self.k,
            "planned_n_ctx": self.planned_n_ctx,
            "used_bytes": self.used_bytes,
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "context_by_kv_type": self.context_by_kv,
            "context": self.context.to_dict() if self.context else None,
            "everything_bytes": self.everything_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "lower_bound_draft": self.lower_bound_draft,
            "target_only_bytes": self.target_only_bytes,
            "target": self.target.to_dict(),
            "drafts": [
                {
                    "id": d.id,
                    "kind": d.kind,
                    "bytes": d.bytes,
                    "value": d.value,
                    "footprint": d.footprint.to_dict() if d.footprint else None,
                    "fits_alone": d.footprint is not None
                    and self.target.total + d.bytes <= self.budget_bytes,
                    "error": d.error,
                }
                for d in self.drafts
            ],
        }


def draft_fits(
    manifests: dict[str, DraftManifest],
    models_dir: Path,
    n_ctx: int,
    values: dict[str, float] | None = None,
    n_gpu_layers: int = 0,
    kv_cache: KVCache = F16,
) -> list[DraftFit]:
    from memspec.drafts.registry import PRIOR_ALPHA

    out = []
    for m in manifests.values():
        value = (values or {}).get(m.id, PRIOR_ALPHA.get(m.kind, 0.5))
        try:
            path = m.model_path(models_dir) if m.file else None
            fp = draft_footprint(m.kind, path, n_ctx, dict(m.params), n_gpu_layers, kv_cache)
            out.append(DraftFit(m.id, m.kind, fp, value))
        except (ModelLoadError, OSError, ValueError) as e:
            out.append(DraftFit(m.id, m.kind, None, value, str(e)))
    return out


def make_plan(
    budget_bytes: int,
    target_path: Path,
    manifests: dict[str, DraftManifest],
    models_dir: Path,
    n_ctx: int | str = 2048,
    k_max: int = 8,
    values: dict[str, float] | None = None,
    n_gpu_layers: int = 0,
    kv_cache: KVCache = F16,
    draft_kv_cache: KVCache | None = None,
) -> Plan:
    """`kv_cache`: the target's cache types; `draft_kv_cache`: model drafts' (the target's).
    n_ctx "auto": resolved as the runtime does (plan_context), the pool's drafts taken in the
    runtime's preload order (weightless first, then smallest first); the plan then keeps
    those drafts resident beside the context it found."""

    def target(n: int, k: int) -> Footprint:
        return target_footprint(target_path, n, k, n_gpu_layers, 1, kv_cache)

    def fits_at(n: int) -> list[DraftFit]:
        return draft_fits(
            manifests, models_dir, n, values, n_gpu_layers, draft_kv_cache or kv_cache
        )

    context = None
    if n_ctx == "auto":

        def preload_order(n: int) -> list[DraftFit]:
            return sorted(fits_at(n), key=lambda d: d.bytes)  # stable: weightless first

        context = plan_context(
            budget_bytes, target_path, k_max, preload_order, "auto", 0, n_gpu_layers, kv_cache
        )
        n_ctx = context.n_ctx or MIN_N_CTX
    n_ctx = int(n_ctx)
    drafts = fits_at(n_ctx)
    avail = [d for d in drafts if d.footprint is not None]
    models = [d for d in avail if d.bytes > 0]
    t_full = target(n_ctx, k_max)
    smallest = min(models, key=lambda d: d.bytes, default=None)
    plan = Plan(
        budget_bytes=budget_bytes,
        n_ctx=n_ctx,
        k_max=k_max,
        kv_cache=kv_cache,
        target=t_full,
        drafts=drafts,
        everything_bytes=t_full.total + sum(d.bytes for d in avail),
        lower_bound_bytes=target(n_ctx, 1).total + smallest.bytes if smallest else None,
        lower_bound_draft=smallest.id if smallest else None,
        target_only_bytes=target(n_ctx, 0).total,
        context=context,
    )
    plan.evict_order = [d.id for d in sorted(models, key=lambda d: (d.value_per_byte, -d.bytes))]

    def settle(shed: list[str], n: int, k: int, resident: list[str], used: int) -> Plan:
        plan.fits, plan.shed, plan.planned_n_ctx, plan.k = True, shed, n, k
        plan.resident, plan.used_bytes = resident, used
        drafts_bytes = used - target(n, k).total
        plan.slots = slots_that_fit(
            budget_bytes, target_path, n, k, drafts_bytes, n_gpu_layers, AUTO_MAX_SLOTS, kv_cache
        )
        one, two = (
            target_footprint(target_path, n, k, n_gpu_layers, s, kv_cache).total for s in (1, 2)
        )
        plan.slot_bytes = two - one
        # Each type with the flash attention a quantized V needs; f16 both ways, as without
        # it the attention scratch grows with the context too.
        swa = kv_cache.swa_full
        kinds = [KVCache("f16", "f16", False, swa), *(KVCache(t, t, True, swa) for t in KV_TYPES)]
        for kv in kinds:

            def residents_at(n: int, kv: KVCache = kv) -> int:  # the drafts' caches alike
                fits = draft_fits(manifests, models_dir, n, values, n_gpu_layers, kv)
                return sum(d.bytes for d in fits if d.id in resident)

            plan.context_by_kv[kv.describe()] = {
                s: longest_context(
                    budget_bytes, target_path, k, residents_at, n_gpu_layers, s, kv, trained
                )
                for s in sorted({1, plan.slots})
            }
        return plan

    trained = trained_context(target_path)
    weightless = [d.id for d in avail if d.bytes == 0 and d.value > 0]
    if plan.everything_bytes <= budget_bytes:
        return settle([], n_ctx, k_max, [d.id for d in avail], plan.everything_bytes)
    if context is not None and context.n_ctx:  # auto: the drafts it kept, as the runtime does
        used = t_full.total + sum(d.bytes for d in avail if d.id in context.drafts)
        return settle(["evict drafts"], n_ctx, k_max, context.drafts, used)
    # 1. Evict drafts: the best value-per-byte set beside the target.
    room = budget_bytes - t_full.total
    chosen = fill_by_value(((d.id, d.value, d.bytes) for d in avail), room)
    if any(d.id in chosen for d in models):
        used = t_full.total + sum(d.bytes for d in avail if d.id in chosen)
        return settle(["evict drafts"], n_ctx, k_max, chosen, used)
    if smallest is not None:
        # 2. Shorten k: the smallest model draft beside a target verifying fewer tokens.
        for k in range(k_max - 1, 0, -1):
            used = target(n_ctx, k).total + smallest.bytes
            if used <= budget_bytes:
                return settle([*SHED_STEPS[:2]], n_ctx, k, weightless + [smallest.id], used)
        # 3. Shorten n_ctx (in llama.cpp's 256-cell steps), with the largest k that then fits.
        for n in range((n_ctx - 1) // KV_PAD * KV_PAD, MIN_N_CTX - 1, -KV_PAD):
            small = {d.id: d for d in fits_at(n) if d.footprint is not None}[smallest.id]
            for k in range(k_max, 0, -1):
                used = target(n, k).total + small.bytes
                if used <= budget_bytes:
                    steps = ["evict drafts", *(["shorten k"] if k < k_max else []), "shorten n_ctx"]
                    return settle(steps, n, k, weightless + [smallest.id], used)
    # 4. Plain decoding (weightless drafts may still propose), at n_ctx or shorter.
    shorter = range((n_ctx - 1) // KV_PAD * KV_PAD, MIN_N_CTX - 1, -KV_PAD)
    for n in [n_ctx, *shorter]:
        k = k_max if weightless else 0
        used = target(n, k).total
        if used <= budget_bytes:
            steps = ["evict drafts", "plain decoding"] if n == n_ctx else [*SHED_STEPS]
            return settle(steps, n, k, weightless, used)
    plan.fits = False
    plan.shed = [*SHED_STEPS]
    return plan


def format_plan(p: Plan) -> str:
    """A human explanation of a plan: the parts, what fits, eviction order, the lower bound."""
    mb = format_size
    lines = [
        f"budget {mb(p.budget_bytes)}; n_ctx {p.n_ctx}, k_max {p.k_max}; "
        f"KV cache {p.kv_cache.describe()}",
        "",
        f"{'part':12s} {'weights':>11s} {'KV':>11s} {'logits':>11s} {'scratch':>11s}"
        f" {'overhead':>11s} {'total':>11s}",
    ]

    def row(name: str, f: Footprint) -> str:
        return (
            f"{name:12s} {mb(f.weights):>11s} {mb(f.kv):>11s} {mb(f.candidates):>11s}"
            f" {mb(f.scratch):>11s} {mb(f.overhead + f.runtime):>11s} {mb(f.total):>11s}"
        )

    lines.append(row("target", p.target))
    for d in p.drafts:
        if d.footprint is None:
            lines.append(f"{d.id:12s} unavailable: {d.error}")
        else:
            lines.append(row(d.id, d.footprint))
    lines += [
        "",
        f"everything resident: {mb(p.everything_bytes)}",
        f"plain decoding (target only): {mb(p.target_only_bytes)}",
    ]
    if p.lower_bound_bytes is not None:
        lines.append(
            f"lower bound that still speculates: {mb(p.lower_bound_bytes)}"
            f" (target at k=1 + {p.lower_bound_draft})"
        )
    lines.append(f"eviction order (lowest value per byte first): {', '.join(p.evict_order)}")
    lines.append("")
    if not p.fits:
        lines.append(
            f"does NOT fit: the target alone needs {mb(p.target_only_bytes)} at n_ctx {p.n_ctx}"
            f" (and more than the budget even at n_ctx {MIN_N_CTX})"
        )
        return "\n".join(lines)
    if p.context_by_kv:
        lines.append(
            "longest context per slot beside the residents, by KV cache (at most the trained "
            "context):"
        )
        for name, row in p.context_by_kv.items():
            cells = "   ".join(f"{s} slot{'s' if s > 1 else ''} {n:>9,}" for s, n in row.items())
            lines.append(f"  {name:34s} {cells}")
        lines.append("")
    if p.context is not None:
        lines += [f"n_ctx auto: {p.context.describe()}", ""]
    shed = ", then ".join(p.shed) if p.shed else "none (everything fits)"
    lines += [
        f"slots: {p.slots} sequences decode together within the budget "
        f"(parallel = 0 takes that many, at most {AUTO_MAX_SLOTS}; each adds "
        f"{mb(p.slot_bytes)})",
        f"shed: {shed}",
        f"resident: {', '.join(p.resident) or '(no draft)'}",
        f"k {p.k}, n_ctx {p.planned_n_ctx}; uses {mb(p.used_bytes)}"
        f" of {mb(p.budget_bytes)} ({mb(p.budget_bytes - p.used_bytes)} spare)",
    ]
    return "\n".join(lines)
