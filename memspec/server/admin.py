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
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

import memspec
from memspec import telemetry
from memspec.config import Settings
from memspec.doctor import kernel_report
from memspec.errors import InvalidRequest
from memspec.kv_cache import KVType
from memspec.memory.huge_pages import huge_page_bytes
from memspec.server.auth import require_admin_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.errors import UnsupportedMediaType
from memspec.server.openai_schema import ERROR_RESPONSES, ErrorResponse
from memspec.server.state import TUNABLE
from memspec.server.worker import EngineWorker
from memspec.units import parse_size

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
    n_ctx: Annotated[int, Field(ge=16, le=1 << 20)] | Literal["auto"] | None = None
    parallel: Annotated[int | None, Field(ge=0, le=64)] = None
    kv_type_k: KVType | None = None
    kv_type_v: KVType | None = None
    draft_kv_type_k: KVType | None = None
    draft_kv_type_v: KVType | None = None
    flash_attn: Literal["auto", "on", "off"] | None = None
    swa_full: bool | None = None
    prefill_chunk: Annotated[int | None, Field(ge=16, le=1 << 16)] = None
    context_overflow: Literal["error", "shift"] | None = None

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
    return [_draft_row(r) for r in _retry(rt.draft_admin.draft_status, [])]


def tuned_settings(ctx: ServerContext) -> dict[str, Any]:
    """The tunable settings now, and the budget in bytes the working set holds."""
    values = ctx.worker.tuning.values()
    return {
        "budget": values["budget"],
        "budget_bytes": ctx.worker.budget_bytes,
        "policy": values["policy"],
        "k_max": values["k_max"],
        "n_ctx": values["n_ctx"],
        "parallel": values["parallel"],
        "kv_type_k": values["kv_type_k"],
        "kv_type_v": values["kv_type_v"],
        "draft_kv_type_k": values["draft_kv_type_k"],
        "draft_kv_type_v": values["draft_kv_type_v"],
        "flash_attn": values["flash_attn"],
        "swa_full": values["swa_full"],
        "prefill_chunk": values["prefill_chunk"],
        "context_overflow": values["context_overflow"],
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
    modelled = _retry(w.targets.used_bytes, 0) + cache.nbytes  # every resident model
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
        "kv_cache": {  # what the contexts store K and V as (memspec.kv_cache)
            "type_k": s.kv_cache.type_k,
            "type_v": s.kv_cache.type_v,
            "draft_type_k": s.draft_kv_cache.type_k,
            "draft_type_v": s.draft_kv_cache.type_v,
            "flash_attn": s.kv_cache.flash_attn,
            "swa_full": s.kv_cache.swa_full,
        },
        "budget_bytes": w.budget_bytes,
        "used_bytes": {"measured": measured, "modelled": modelled},
        "memory": snap,
        "queue": {"depth": w.queue_depth, "max": s.max_queue, "busy": w.busy},
        "slots": {"total": w.slots, "active": w.active_slots, "parallel": s.parallel},
        "engine": {"state": w.state, "heartbeat_age_s": round(w.heartbeat_age_s, 2)},
        "warnings": list(w.warnings) + ([chat["warning"]] if chat and chat["warning"] else []),
        # The build's kernels, and the target's own: repacked weights (under the row rule,
        # backends/llama_cpp.py) and whether its logits are independent of the batch.
        "kernels": _kernels()
        | _target_kernels(rt)
        | {"exactness": s.exactness, "anon_huge_page_bytes": huge_page_bytes()},
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
        # Several models under the budget (memspec.targets): every servable one, resident or
        # not, its bytes and share, keep_alive expiry, loads and evictions.
        "residency": s.residency,
        "models": _retry(w.models_status, []),
        # Files in the models dir that are not served (not a usable GGUF), and why.
        "bad_models": w.catalog.bad_models(),
        # Drafts for whatever arrives (memspec.draft_builds): each family queued, building,
        # built (its drafts) or failed (why).
        "draft_builds": ctx.draft_builds.status() if ctx.draft_builds is not None else [],
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
        rt.draft_admin.manifest(draft_id)  # unknown or invalid id: 404
        if action == "load":
            rt.draft_admin.load_draft(draft_id)
        elif action == "evict":
            rt.draft_admin.evict_draft(draft_id)
        else:
            rt.draft_admin.pin(draft_id, action == "pin")
        row = next(r for r in rt.draft_admin.draft_status() if r["id"] == draft_id)
        return _draft_row(row)

    row = await ctx.control(run, f"draft {action}")
    log.info("admin: draft %s %s", draft_id, action)
    return {"ok": True, "draft": row}


@router.post("/tune")
async def tune(body: Annotated[TuneRequest, Body()], ctx: Ctx) -> dict[str, Any]:
    changes = body.model_dump(exclude_none=True)
    if not changes:
        raise InvalidRequest(f"nothing to tune: send any of {', '.join(TUNABLE)}")
    await ctx.control(lambda w: w.tuning.tune(w, changes), "tune")
    log.info("admin: tuned %s", ", ".join(f"{k}={v}" for k, v in changes.items()))
    return {"ok": True, "settings": tuned_settings(ctx)}


@router.post("/reset")
async def reset(ctx: Ctx) -> dict[str, Any]:
    """Undo every tune: the configured settings (flags, env, TOML, defaults) again, live, and
    no tuned file left to apply at the next start."""
    changed = await ctx.control(lambda w: w.tuning.reset(w), "reset")
    log.info("admin: reset to the configured settings (%s)", ", ".join(changed) or "no change")
    return {"ok": True, "reset": changed, "settings": tuned_settings(ctx)}
