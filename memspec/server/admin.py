"""Admin API (what `memspec-ctl` speaks): status, the draft pool, live tuning.

GET  /admin/status                      daemon, budget, memory, queue, throughput, drafts
GET  /admin/drafts                      {"drafts": [...]}, each with compatible, reason (tokenizer)
POST /admin/drafts/{id}/load|evict|pin|unpin   {"ok": true, "draft": {...}}; load or pin of an
                                        incompatible draft: 400 draft_incompatible
POST /admin/tune {budget?, policy?, k_max?, n_ctx?}   {"ok": true, "settings": {...}}
POST /admin/reset                       back to the configured settings; the tuned file removed

Every POST needs `Content-Type: application/json` (415 otherwise): a plain HTML form, which a
web page can send anywhere, can only send form or text/plain bodies. Changes run on the engine
thread between generations (never under a running one), at most `admin_queue` waiting (429).
A tune is persisted atomically before it is applied and rolled back if applying it fails.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import psutil
from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

import memspec
from memspec import telemetry
from memspec.config import Settings
from memspec.doctor import kernel_report
from memspec.errors import BudgetExceeded, InvalidRequest
from memspec.memory.limits import budget_ceiling
from memspec.server.auth import require_admin_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.errors import UnsupportedMediaType
from memspec.server.openai_schema import ERROR_RESPONSES, ErrorResponse
from memspec.server.state import TUNABLE, clear_state, load_state, save_state, state_path
from memspec.server.worker import EngineWorker
from memspec.units import format_size, parse_size

log = logging.getLogger("memspec.server")


async def require_json(request: Request) -> None:
    """A state change must come as JSON: no browser sends that cross-site without a CORS
    preflight, which HostGuard refuses for a foreign origin."""
    if request.method in ("GET", "HEAD", "OPTIONS"):
        return
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise UnsupportedMediaType(
            f"admin changes need Content-Type: application/json (got {kind[:80] or 'none'}); "
            "send a JSON body, {} when there is nothing to say",
            code="unsupported_media_type",
        )


router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[Depends(require_admin_key), Depends(require_json)],
    responses={
        **ERROR_RESPONSES,
        415: {"model": ErrorResponse, "description": "a change sent without a JSON body"},
        429: {"model": ErrorResponse, "description": "admin jobs queue full (see Retry-After)"},
    },
)

DRAFT_KEYS = (
    "id", "kind", "bytes", "resident", "pinned", "acceptance", "value", "requests", "compatible",
    "reason", "state", "error",
)  # fmt: skip


class TuneRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    budget: Annotated[int | str | None, Field(description='bytes or a size: "1.5GiB"')] = None
    policy: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = None
    k_max: Annotated[int | None, Field(ge=0, le=64)] = None
    n_ctx: Annotated[int | None, Field(ge=16, le=1 << 20)] = None
    parallel: Annotated[int | None, Field(ge=0, le=64)] = None

    @field_validator("budget")
    @classmethod
    def _size(cls, v: int | str | None) -> int | str | None:
        if v is not None and parse_size(v) <= 0:
            raise ValueError("budget must be positive")
        return v


def _draft_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in DRAFT_KEYS} | {"tags": row.get("tags", [])}


def _retry(fn: Any, default: Any) -> Any:
    """Read runtime state from the HTTP thread (the engine may mutate it concurrently)."""
    for _ in range(3):
        try:
            return fn()
        except RuntimeError:  # "dictionary changed size during iteration": read again
            continue
    return default


def draft_rows(ctx: ServerContext) -> list[dict[str, Any]]:
    rt = ctx.worker.runtime
    if rt is None:
        return []
    return [_draft_row(r) for r in _retry(rt.draft_status, [])]


def tuned_settings(ctx: ServerContext) -> dict[str, Any]:
    s = ctx.settings
    return {
        "budget": s.budget,
        "budget_bytes": s.budget_bytes,
        "policy": s.policy,
        "k_max": s.k_max,
        "n_ctx": s.n_ctx,
        "parallel": s.parallel,
    }


@functools.cache
def _kernels() -> dict[str, Any]:
    """Which kernels run (memspec doctor's report): fixed for the process, so read once."""
    return kernel_report()


def _target_kernels(rt: Any) -> dict[str, Any]:
    if rt is None or rt.target is None:
        return {}
    d = rt.target.describe()
    return {
        "target_weight_repack": bool(d.get("weight_repack", False)),
        "target_batch_invariant": bool(d.get("batch_invariant", False)),
    }


def _devices_unloaded(s: Settings, error: str | None) -> list[dict[str, Any]]:
    """The devices configured while the target is not loaded (e.g. a worker unreachable)."""
    return [{"device": "local"}] + [
        {"device": e, "state": "waiting", "error": error} for e in s.rpc
    ]


def status(ctx: ServerContext) -> dict[str, Any]:
    s, w = ctx.settings, ctx.worker
    rt = w.runtime
    snap = telemetry.snapshot()
    measured = telemetry.process_bytes(snap) or 0
    if rt is not None and hasattr(rt.target, "process_bytes"):  # a target in its own process
        measured += rt.target.process_bytes()
    if snap.get("jetson") and snap.get("nvmap_used_bytes"):
        measured += snap["nvmap_used_bytes"]  # GPU allocations in the shared DRAM
    cache = w.prefix_cache
    modelled = (_retry(rt.modelled_bytes, 0) if rt is not None else 0) + cache.nbytes
    n_ctx = rt.target.n_ctx if rt is not None and rt.target is not None else s.n_ctx
    chat = rt.chat_template.status() if rt is not None else None  # where its template came from
    return {
        "version": memspec.__version__,
        "state": "shutting_down" if ctx.shutting_down else w.state,
        "uptime_s": round(ctx.uptime_s, 1),
        "model": ctx.model_id,
        "target": s.target,
        "chat_template": chat,
        "backend": s.backend,
        "policy": s.policy,
        "k_max": s.k_max,
        "n_ctx": n_ctx,
        "budget_bytes": s.budget_bytes,
        "used_bytes": {"measured": measured, "modelled": modelled},
        "memory": snap,
        "queue": {"depth": w.queue_depth, "max": s.max_queue, "busy": w.busy},
        "slots": {"total": w.slots, "active": w.active_slots, "parallel": s.parallel},
        "engine": {"state": w.state, "heartbeat_age_s": round(w.heartbeat_age_s, 2)},
        "warnings": list(w.warnings) + ([chat["warning"]] if chat and chat["warning"] else []),
        # The build's kernels, and the target's own: repacked weights (under the row rule,
        # backends/llama_cpp.py) and whether its logits are independent of the batch.
        "kernels": _kernels() | _target_kernels(rt),
        "devices": rt.devices() if rt is not None else _devices_unloaded(s, w.error),
        "tokens_per_s_recent": w.tokens_per_s_recent(),
        "requests_served": w.requests_served,
        "prefix_cache": {
            "bytes": cache.nbytes,
            "capacity": w.prefix_cache_capacity(),
            "entries": len(cache),
            "saves": cache.stats.saves,
            "restores": cache.stats.restores,
            "restored_tokens": cache.stats.restored_tokens,
            "evictions": cache.stats.evictions,
        },
        "working_set": _retry(rt.memory_status, None) if rt is not None else None,
        "drafts": draft_rows(ctx),
    }


@router.get("/status")
async def get_status(ctx: Ctx) -> dict[str, Any]:
    return await asyncio.to_thread(status, ctx)


@router.get("/drafts")
async def list_drafts(ctx: Ctx) -> dict[str, Any]:
    return {"drafts": await asyncio.to_thread(draft_rows, ctx)}


@router.post("/drafts/{draft_id}/{action}")
async def draft_action(
    draft_id: str,
    action: Literal["load", "evict", "pin", "unpin"],
    ctx: Ctx,
    _body: Annotated[
        dict[str, Any] | None, Body(description="{} (a JSON body is required)")
    ] = None,
) -> dict[str, Any]:
    def run(worker: EngineWorker) -> dict[str, Any]:
        rt = worker.runtime
        rt.manifest(draft_id)  # unknown or invalid id: 404
        if action == "load":
            rt.load_draft(draft_id)
        elif action == "evict":
            rt.evict_draft(draft_id)
        else:
            rt.pin(draft_id, action == "pin")
        row = next(r for r in rt.draft_status() if r["id"] == draft_id)
        return _draft_row(row)

    row = await ctx.control(run, f"draft {action}")
    log.info("admin: draft %s %s", draft_id, action)
    return {"ok": True, "draft": row}


def check_tune(worker: EngineWorker, changes: dict[str, Any]) -> None:
    """Refuse (400) what could never run, before anything is written: an unknown policy, a
    budget below what the target needs or above the machine's memory. Persisting such a value
    would break every request, or keep the daemon from starting again after a restart."""
    rt = worker.runtime
    if "policy" in changes:
        if rt is not None and changes["policy"] not in rt.policies:
            raise InvalidRequest(
                f"unknown policy {changes['policy']!r}; known: {', '.join(sorted(rt.policies))}",
                param="policy",
                code="invalid_value",
            )
    if "budget" in changes:
        budget = parse_size(changes["budget"])
        ceiling = budget_ceiling() or (psutil.virtual_memory().total, "this machine's memory")
        if budget > ceiling[0]:
            # Persisted, such a budget gets the daemon OOM-killed at every start.
            raise InvalidRequest(
                f"budget {format_size(budget)} exceeds {ceiling[1]} ({format_size(ceiling[0])})",
                param="budget",
                code="invalid_value",
            )
        reserved = rt.reserved_bytes if rt is not None else 0
        if "n_ctx" not in changes and "parallel" not in changes and budget < reserved:
            raise InvalidRequest(
                f"budget {format_size(budget)} is below what the target needs at n_ctx "
                f"{worker.settings.n_ctx} ({format_size(reserved)}); see `memspec plan`",
                param="budget",
                code="budget_too_small",
            )


def _as_tune_error(e: BudgetExceeded, changes: dict[str, Any]) -> InvalidRequest:
    """A tune that does not fit is the caller's request to fix (400), not a server fault."""
    param = next((k for k in ("budget", "n_ctx", "parallel") if k in changes), e.param)
    return InvalidRequest(e.message, param=param, code="budget_too_small")


def apply_tune(
    worker: EngineWorker, changes: dict[str, Any], path: Path, persist: dict[str, Any] | None
) -> None:
    """Engine thread: check, persist (`persist`: the new file; None: merged into the old),
    apply; on any failure put settings, budget and file back as they were."""
    check_tune(worker, changes)
    s = worker.settings
    before = {k: getattr(s, k) for k in TUNABLE}
    persisted = load_state(path)
    save_state(path, {**persisted, **changes} if persist is None else persist)  # 507 first
    budget_applied = False
    try:
        rt = worker.runtime
        if "budget" in changes and rt is not None:  # evicts to fit; raises if pinned block
            rt.set_budget(parse_size(changes["budget"]))
            budget_applied = True
        for key in ("budget", "policy", "k_max"):
            if key in changes:
                setattr(s, key, changes[key])  # as sent ("1.5GiB"), as persisted
                if rt is not None and rt.settings is not s:
                    setattr(rt.settings, key, changes[key])
        n_ctx, parallel = changes.get("n_ctx", s.n_ctx), changes.get("parallel", s.parallel)
        if (n_ctx, parallel) != (s.n_ctx, s.parallel):
            worker.reload_runtime(n_ctx, parallel)
        worker.prefix_cache.shrink()
    except BaseException as e:
        for key, value in before.items():
            setattr(s, key, value)
        rt = worker.runtime
        if budget_applied and rt is not None:
            try:
                rt.set_budget(parse_size(before["budget"]))
            except Exception:  # noqa: BLE001 - the original error is the one to report
                log.exception("could not restore the budget")
        try:
            save_state(path, persisted)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            log.exception("could not roll back %s", path)
        if isinstance(e, BudgetExceeded):
            raise _as_tune_error(e, changes) from e
        raise


@router.post("/tune")
async def tune(body: Annotated[TuneRequest, Body()], ctx: Ctx) -> dict[str, Any]:
    changes = body.model_dump(exclude_none=True)
    if not changes:
        raise InvalidRequest(f"nothing to tune: send any of {', '.join(TUNABLE)}")
    path = state_path(ctx.settings)
    await ctx.control(lambda w: apply_tune(w, changes, path, None), "tune")
    log.info("admin: tuned %s", ", ".join(f"{k}={v}" for k, v in changes.items()))
    return {"ok": True, "settings": tuned_settings(ctx)}


@router.post("/reset")
async def reset(ctx: Ctx) -> dict[str, Any]:
    """Undo every tune: the configured settings (flags, env, TOML, defaults) again, live, and
    no tuned file left to apply at the next start."""
    path = state_path(ctx.settings)

    def run(worker: EngineWorker) -> list[str]:
        s = worker.settings
        changes = {k: v for k, v in ctx.configured.items() if getattr(s, k) != v}
        if changes:
            apply_tune(worker, changes, path, {})
        clear_state(path)
        return sorted(changes)

    changed = await ctx.control(run, "reset")
    log.info("admin: reset to the configured settings (%s)", ", ".join(changed) or "no change")
    return {"ok": True, "reset": changed, "settings": tuned_settings(ctx)}
