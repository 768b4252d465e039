"""Live tuning: the one place the daemon's tunable settings change after start.

Settings are frozen once loaded (memspec.config). What `memspec-ctl tune` (POST /admin/tune)
and `memspec-ctl reset` (POST /admin/reset) change, the TUNABLE keys (budget, policy, k_max,
n_ctx, parallel, the KV cache types and flash_attn), is held here: `current` is the Settings
the engine runs with now (a new frozen copy per change), `configured` what flags, env, TOML
and defaults say (what a reset restores).

A tune is checked, persisted to tuned.json (memspec.server.state) before it is applied, and
rolled back (values, budget and file) if applying it fails. The budget in bytes is held by the
runtime's working set alone: a budget tune hands it there (Runtime.set_budget). Policy and
k_max reach the runtime as its settings, replaced; the RELOAD_KEYS rebuild the runtime.
Engine thread only, except the reads (`current`, `values`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from memspec.config import Settings
from memspec.errors import BudgetExceeded, InvalidRequest
from memspec.memory.limits import budget_ceiling
from memspec.memory.plan import least_target_bytes
from memspec.server.state import (
    RELOAD_KEYS,
    TUNABLE,
    clear_state,
    load_state,
    reject_state,
    save_state,
)
from memspec.server.state import state_path as _state_path
from memspec.units import format_size, parse_size

if TYPE_CHECKING:
    from memspec.server.worker import EngineWorker

log = logging.getLogger("memspec.server")

RUNTIME_KEYS = ("policy", "k_max", "prefill_chunk", "context_overflow")
# read by the runtime per request: handed to it on a tune


class Tuning:
    """The tunable settings now, the configured ones, and their tuned.json."""

    def __init__(self, settings: Settings, configured: Settings | None = None):
        """`settings`: what to start with (tuned state applied); `configured`: the same without
        the tuned state (None when nothing was tuned at start)."""
        self.current = settings
        self.configured = configured if configured is not None else settings
        self.tuned_at_start = configured is not None
        self.path: Path = _state_path(settings)

    # --- reads ------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """The tunable values now (as sent: "1.5GiB" stays a string), for status and replies."""
        s = self.current
        return {k: getattr(s, k) for k in TUNABLE}

    def configured_values(self) -> dict[str, Any]:
        return {k: getattr(self.configured, k) for k in TUNABLE}

    def _replace(self, **values: Any) -> None:
        # Values come validated (TuneRequest, or Settings itself for the configured ones).
        self.current = self.current.model_copy(update=values)

    # --- at start -----------------------------------------------------------------------------
    def fall_back(self) -> list[str]:
        """The tuned values could not load: run on the configured ones, set the tuned file
        aside (a bad tune must not stop every restart). Returns the keys that were tuned."""
        tuned = sorted(k for k, v in self.configured_values().items() if self.values()[k] != v)
        self.current = self.configured
        return tuned

    def reject_file(self, keys: list[str] | None = None) -> Path | None:
        return reject_state(self.path, keys)

    def replace_policy(self, use: str) -> None:
        """An unknown policy name was configured or tuned: run on `use`; a tuned one is set
        aside so that the next start does not trip on it again."""
        name = self.current.policy
        self._replace(policy=use)
        if self.tuned_at_start and name != self.configured.policy:
            self.reject_file(keys=["policy"])

    # --- tune and reset -----------------------------------------------------------------------
    def check(self, worker: EngineWorker, changes: dict[str, Any]) -> None:
        """Refuse (400) what could never run, before anything is written: an unknown policy, a
        budget below what the target needs or above the machine's memory. Persisting such a
        value would break every request, or keep the daemon from starting after a restart."""
        rt = worker.runtime
        kv_keys = [k for k in changes if k.startswith(("kv_", "draft_kv_", "flash_attn"))]
        if kv_keys:
            try:  # a quantized V cache with flash_attn off is a context llama.cpp refuses
                self.current.model_copy(update=changes).draft_kv_cache  # noqa: B018
            except ValueError as e:
                raise InvalidRequest(str(e), param=kv_keys[0], code="invalid_value") from None
        if "policy" in changes and rt is not None:
            try:
                rt.scheduler.check_policy(changes["policy"])
            except InvalidRequest as e:  # the request's check, as a tune's invalid value
                raise InvalidRequest(e.message, param="policy", code="invalid_value") from None
        if "budget" in changes:
            budget = parse_size(changes["budget"])
            ceiling = budget_ceiling() or (psutil.virtual_memory().total, "this machine's memory")
            if budget > ceiling[0]:
                # Persisted, such a budget gets the daemon OOM-killed at every start.
                raise InvalidRequest(
                    f"budget {format_size(budget)} exceeds {ceiling[1]} "
                    f"({format_size(ceiling[0])})",
                    param="budget",
                    code="invalid_value",
                )
            reserved = rt.reserved_bytes if rt is not None else 0
            if self.resizes(changes) and rt is not None:  # n_ctx auto follows the budget
                c = self.current.model_copy(update=changes)
                least = least_target_bytes(
                    rt.target.path, c.k_max, c.n_gpu_layers, c.parallel or 1, c.kv_cache
                )
                if budget < least:
                    raise InvalidRequest(
                        f"budget {format_size(budget)} is below what the target needs at the "
                        f"shortest context n_ctx auto gives ({format_size(least)}); see "
                        "`memspec plan`",
                        param="budget",
                        code="budget_too_small",
                    )
            elif not any(k in changes for k in RELOAD_KEYS) and budget < reserved:
                raise InvalidRequest(
                    f"budget {format_size(budget)} is below what the target needs at n_ctx "
                    f"{self.current.n_ctx} ({format_size(reserved)}); see `memspec plan`",
                    param="budget",
                    code="budget_too_small",
                )

    def tune(self, worker: EngineWorker, changes: dict[str, Any]) -> None:
        """`memspec-ctl tune`: apply `changes`, merged into the tuned file."""
        self._apply(worker, changes, persist=None)

    def reset(self, worker: EngineWorker) -> list[str]:
        """`memspec-ctl reset`: the configured values again, live, and no tuned file left to
        apply at the next start. Returns the keys that changed."""
        now = self.values()
        changes = {k: v for k, v in self.configured_values().items() if now[k] != v}
        if changes:
            self._apply(worker, changes, persist={})
        clear_state(self.path)
        return sorted(changes)

    def _apply(
        self, worker: EngineWorker, changes: dict[str, Any], persist: dict[str, Any] | None
    ) -> None:
        """Check, persist (`persist`: the new file; None: merged into the old), apply; on any
        failure put values, budget and file back as they were."""
        self.check(worker, changes)
        before = self.current
        persisted = load_state(self.path)
        save_state(self.path, {**persisted, **changes} if persist is None else persist)  # 507
        budget_applied = False
        try:
            if "budget" in changes or any(k in changes for k in RELOAD_KEYS):
                # The budget and the context are the default target's: the other models give
                # their shares back first, and load again on demand with the new settings.
                worker.single_target()
            resize = self.resizes(changes) and worker.runtime is not None
            rt = worker.runtime
            if "budget" in changes and rt is not None and not resize:  # evicts to fit
                rt.set_budget(parse_size(changes["budget"]))
                budget_applied = True
            self._replace(**{k: changes[k] for k in ("budget", *RUNTIME_KEYS) if k in changes})
            if rt is not None:
                self.hand_to_runtime(rt)
            s = self.current
            shape = {k: changes[k] for k in RELOAD_KEYS if k in changes}
            if resize or any(getattr(s, k) != v for k, v in shape.items()):
                worker.reload_runtime(shape)
            worker.prefix_cache.shrink()
        except BaseException as e:
            self.current = before
            rt = worker.runtime
            if rt is not None:
                self.hand_to_runtime(rt)
                if budget_applied:
                    try:
                        rt.set_budget(before.budget_bytes)
                    except Exception:  # noqa: BLE001 - the original error is the one to report
                        log.exception("could not restore the budget")
            try:
                save_state(self.path, persisted)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                log.exception("could not roll back %s", self.path)
            if isinstance(e, BudgetExceeded):
                raise _as_tune_error(e, changes) from e
            raise

    def resizes(self, changes: dict[str, Any]) -> bool:
        """A budget tune while n_ctx is auto: the runtime is rebuilt, its context sized to the
        new budget (memspec.memory.plan.plan_context)."""
        return "budget" in changes and changes.get("n_ctx", self.current.n_ctx) == "auto"

    def shape(self) -> dict[str, Any]:
        """What a runtime reload changes, as it is now."""
        return {k: getattr(self.current, k) for k in RELOAD_KEYS}

    def set_shape(self, shape: dict[str, Any]) -> None:
        """A runtime reload's context, slots and cache types (worker.reload_runtime)."""
        self._replace(**shape)

    def hand_to_runtime(self, rt: Any) -> None:
        """The runtime reads policy and k_max per request from its own settings: give it the
        live ones (a new frozen copy; what else it was built with is kept)."""
        live = {k: getattr(self.current, k) for k in RUNTIME_KEYS}
        if any(getattr(rt.settings, k) != v for k, v in live.items()):
            rt.settings = rt.settings.model_copy(update=live)


def _as_tune_error(e: BudgetExceeded, changes: dict[str, Any]) -> InvalidRequest:
    """A tune that does not fit is the caller's request to fix (400), not a server fault."""
    param = next((k for k in ("budget", *RELOAD_KEYS) if k in changes), e.param)
    return InvalidRequest(e.message, param=param, code="budget_too_small")
