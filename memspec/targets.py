"""Several targets under one budget: one Runtime per resident model, and their budget shares.

    targets = Targets(catalog, factory)
    targets.load("gemma3:270m", settings, victims=[...])   # engine thread
    targets.runtime("gemma3:270m")                           # None while not resident

Each resident model is a Runtime (memspec.runtime): its backend, slots, drafts and costs. Its
working set holds a *share* of the budget: its target first, then its drafts. The shares never
add up to more than the budget. A model loads with what is free as its share, after the
others have handed back what they do not use and the victims its residency policy picked
(memspec.scheduler.residency) are unloaded. The model scheduler decides
(memspec.scheduler.models); this object only does it, on the engine thread, and keeps each
model's counts: loads, evictions, seconds spent loading, last use and expiry (keep_alive).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memspec.backends.base import BackendOptions
from memspec.backends.shared_weights import SHARED_MODELS, weights_key
from memspec.catalog import ModelCatalog, ServableModel
from memspec.config import Settings
from memspec.errors import (
    BudgetExceeded,
    LoadAbandoned,
    MemSpecError,
    ModelDoesNotFit,
    ModelLoadError,
    UnknownModel,
    UnusableModelFile,
)
from memspec.memory.footprint import Footprint, target_footprint, vocab_bytes
from memspec.memory.gguf_info import read_shape
from memspec.memory.heap import return_freed_memory
from memspec.paths import models_dir
from memspec.runtime import Runtime
from memspec.scheduler.residency import ModelView
from memspec.units import format_size

log = logging.getLogger(__name__)

# A load's duration before one is measured (seconds): what the policies weigh a switch with.
FIRST_LOAD_S = 2.0
# The context a need is estimated at when n_ctx is sized by the runtime itself.
MIN_CTX_ESTIMATE = 512


@dataclass
class ModelStats:
    """One model's residency history (kept while it is not resident)."""

    loads: int = 0
    evictions: int = 0
    load_s_total: float = 0.0
    last_load_s: float = FIRST_LOAD_S
    last_used: float = 0.0  # monotonic
    expires_at: float | None = None  # monotonic; None: no expiry
    last_evicted_why: str = ""
    served: int = 0  # requests admitted since its last load
    abandoned: int = 0  # loads stopped because every request waiting for them had gone
    wasted: int = 0  # loads evicted before they served a request


class Targets:
    def __init__(
        self,
        catalog: ModelCatalog,
        factory: Callable[[Settings], Runtime],
        budget: Callable[[], int],
        on_change: Callable[[str, str], None] | None = None,
    ):
        """`factory(settings)` builds a Runtime for settings.target; `budget()` is the whole
        budget now (a live tune changes it); `on_change(model, what)` hears of every load
        ("load") and unload ("evict", "expire", "unload")."""
        self.catalog = catalog
        self._factory = factory
        self._budget = budget
        self._on_change = on_change
        self.runtimes: dict[str, Runtime] = {}
        self.stats: dict[str, ModelStats] = {}
        self._needs: dict[tuple[Any, ...], Footprint] = {}  # per file and context shape
        # Why a model requests wait for could not be sized (its file unreadable): the worker
        # fails those requests instead of scheduling them (views() leaves the model out).
        self.view_errors: dict[str, MemSpecError] = {}

    # --- what is resident -------------------------------------------------------------------
    def runtime(self, name: str) -> Runtime | None:
        return self.runtimes.get(name)

    def stat(self, name: str) -> ModelStats:
        return self.stats.setdefault(name, ModelStats())

    @property
    def resident(self) -> list[str]:
        return list(self.runtimes)

    def free_slots(self, name: str) -> int:
        rt = self.runtimes.get(name)
        return rt.slot_table.free() if rt is not None else 0

    def admitted(self, name: str) -> None:
        """A request took a slot of `name` (a load that served one was not wasted)."""
        self.stat(name).served += 1

    def unservable(self, name: str) -> MemSpecError:
        """Why requests for `name` cannot be scheduled: its file unreadable, marked bad, or
        gone from the models dir."""
        gone = UnknownModel(f"model {name!r} is no longer in the models dir", param="model")
        error = self.view_errors.get(name) or self.catalog.unusable(name) or gone
        return error if isinstance(error, MemSpecError) else ModelLoadError(str(error))

    def free_budget(self) -> int:
        """The budget no resident model's share holds now."""
        return self._budget() - self.shares()

    def embed_share(self, name: str) -> None:
        """Set up `name`'s embedding context: the others hand back the share they do not use,
        and `name` gets the free budget. BudgetExceeded if the context still cannot fit."""
        rt = self.runtimes[name]
        for other in self.runtimes.values():  # each keeps what it uses
            if other is not rt:
                other.set_budget(max(other.reserved_bytes, other.modelled_bytes()))
        rt.set_budget(rt.budget_bytes + max(0, self._budget() - self.shares()))
        rt.embeddings.get()

    def shares(self) -> int:
        """The budget the resident models' working sets hold, together."""
        return sum(rt.budget_bytes for rt in list(self.runtimes.values()))

    def free_after_handback(self) -> int:
        """The budget free once every resident model hands back the share it does not use
        (what `load` can give a new model before unloading any)."""
        held = sum(max(rt.reserved_bytes, rt.modelled_bytes()) for rt in self.runtimes.values())
        return self._budget() - held

    def used_bytes(self) -> int:
        """What the resident models hold (modelled): targets, KV, drafts, embedding contexts."""
        return sum(rt.modelled_bytes() for rt in list(self.runtimes.values()))

    def need_bytes(self, model: ServableModel, settings: Settings) -> int:
        """What loading `model` needs at least: its weights, one slot's KV and buffers."""
        return self._need(model, settings).total

    def _need(self, model: ServableModel, settings: Settings) -> Footprint:
        n_ctx = settings.n_ctx if isinstance(settings.n_ctx, int) else MIN_CTX_ESTIMATE
        slots = max(1, settings.parallel)
        kv = settings.kv_cache
        try:  # one entry per version of the file: a replaced file is sized again
            st = model.path.stat()
            version = (st.st_size, st.st_mtime_ns)
        except OSError:
            version = (0, 0)
        key = (model.path, version, n_ctx, settings.k_max, settings.n_gpu_layers, slots, kv)
        if key not in self._needs:  # read_shape parses the header: once per shape
            self._needs[key] = target_footprint(
                model.path, n_ctx, settings.k_max, settings.n_gpu_layers, slots, kv
            )
        return self._needs[key]

    def weights_held(self, model: ServableModel, settings: Settings) -> int:
        """The bytes of `model`'s weights (and vocabulary) a resident model holds already as
        its draft (the 0.5B, the 1.5B's sibling): loading it as a target adds its context only,
        and the draft's charge for them moves to it (backends.shared_weights)."""
        if settings.rpc or settings.backend != "llama_cpp":
            return 0
        # The options the model's Runtime loads its target with (memspec.runtime).
        options = BackendOptions(
            weight_repack=settings.weight_repack, n_gpu_layers=settings.n_gpu_layers
        )
        if not SHARED_MODELS.held_as(weights_key(model.path, options), "draft"):
            return 0
        return self._need(model, settings).weights + vocab_bytes(read_shape(model.path))

    def _reprice_drafts(self, path: Path, loaded: str | None = None) -> None:
        """A target on `path` loaded (`loaded`: its name) or left: the drafts that share its
        file stop costing their weights, or cost them again. Each other model whose drafts
        name the file reads their bytes again and its share is fitted: on a load it gives
        back what it no longer uses (the new model's share paid for it); on an unload it
        grows by the weights it pays for now, out of the share the leaving model gave back."""
        name = path.resolve()
        for other, rt in list(self.runtimes.items()):
            ws = rt.working_set
            files = [m.model_path(models_dir()) for m in rt.manifests.values() if m.file]
            if other == loaded or ws is None or all(f.resolve() != name for f in files):
                continue
            ws.refresh_bytes()
            used = rt.modelled_bytes()
            if loaded is not None:
                rt.set_budget(max(rt.reserved_bytes, used))
            elif used > rt.budget_bytes:
                rt.set_budget(used)

    def views(
        self, settings: Settings, in_flight: dict[str, int], queued: dict[str, int]
    ) -> list[ModelView]:
        """The residency policy's view: every resident model, and every one requests wait for."""
        out: list[ModelView] = []
        pinned = set(settings.pinned_models)
        self.view_errors = {}
        for name in dict.fromkeys([*self.runtimes, *queued]):
            rt = self.runtimes.get(name)
            if rt is None:
                model = self.catalog.find(name)
                if model is None:
                    continue
                try:  # reads its header: a file gone bad since it was listed fails here
                    size = self.need_bytes(model, settings) - self.weights_held(model, settings)
                except Exception as e:  # noqa: BLE001 - that model's requests fail, not the engine
                    error = self._unusable(model, e)
                    self.view_errors[name] = (
                        error if isinstance(error, MemSpecError) else ModelLoadError(str(error))
                    )
                    continue
            else:
                size = rt.budget_bytes
            st = self.stat(name)
            out.append(
                ModelView(
                    name=name,
                    resident=rt is not None,
                    bytes=size,
                    in_flight=in_flight.get(name, 0),
                    queued=queued.get(name, 0),
                    pinned=name in pinned or bool(pinned & (rt.model_aliases if rt else set())),
                    last_used=st.last_used,
                    load_s=st.last_load_s,
                )
            )
        return out

    # --- load and unload (engine thread) ------------------------------------------------------
    def load(self, name: str, settings: Settings, victims: list[str]) -> Runtime:
        """Unload `victims`, take back what the others do not use, and load `name` with the
        free budget as its share; BudgetExceeded (a 503 with the numbers) if it cannot fit."""
        model = self.catalog.find(name)
        if model is None:
            raise self.catalog.unusable(name) or UnknownModel(
                f"The model {name!r} does not exist (see /api/tags)", param="model"
            )
        for victim in victims:
            self.unload(victim, "evict")
        for rt in list(self.runtimes.values()):
            rt.set_budget(max(rt.reserved_bytes, rt.modelled_bytes()))
        budget = self._budget()
        free = budget - self.shares()
        held = self.weights_held(model, settings)
        need = self.need_bytes(model, settings) - held
        if need > free:
            held = ", ".join(
                f"{n} {format_size(rt.modelled_bytes())}" for n, rt in self.runtimes.items()
            )
            raise ModelDoesNotFit(
                f"model {name!r} needs {format_size(need)}; {format_size(free)} of the budget "
                f"{format_size(budget)} is free"
                + (f" beside {held} (in use or pinned)" if held else ""),
                param="model",
            )
        t0 = time.monotonic()
        st = self.stat(name)
        try:
            # Its share pays for the weights a draft elsewhere held: that draft stops paying.
            rt = self._factory(self.model_settings(model, settings, free + held))
        except LoadAbandoned:
            st.abandoned += 1
            raise
        except Exception as e:
            raise self._unusable(model, e) from e
        st.last_load_s = time.monotonic() - t0
        st.load_s_total += st.last_load_s
        st.loads += 1
        st.served = 0
        st.last_used = time.monotonic()
        self.runtimes[name] = rt
        self._reprice_drafts(model.path, loaded=name)
        log.info(
            "model %s loaded in %.2f s (share %s%s)",
            name,
            st.last_load_s,
            format_size(free + held),
            f", weights shared with a draft: {format_size(held)}" if held else "",
        )
        if self._on_change is not None:
            self._on_change(name, "load")
        return rt

    def _unusable(self, model: ServableModel, error: Exception) -> Exception:
        """A load or header read of `model` failed: a file that is gone is an unknown model;
        one that cannot be loaded is marked bad (until its size or mtime change: a second
        request fails at once) and its requests are at fault (422). Budget errors pass."""
        if isinstance(error, (BudgetExceeded, UnusableModelFile)):
            return error
        if not model.path.is_file():
            return UnknownModel(
                f"model file {model.path.name} left the models dir while it was loaded",
                param="model",
            )
        if not isinstance(error, ModelLoadError):
            return error
        self.catalog.mark_bad(model.path, error.message)
        return UnusableModelFile(
            f"model file {model.path.name} could not be loaded: {error.message}", param="model"
        )

    def adopt(self, name: str, rt: Runtime, load_s: float) -> None:
        """A runtime loaded elsewhere (the daemon's first, with the whole budget)."""
        self.runtimes[name] = rt
        st = self.stat(name)
        st.loads += 1
        st.last_load_s = load_s
        st.load_s_total += load_s
        st.last_used = time.monotonic()
        if self._on_change is not None:
            self._on_change(name, "load")

    def model_settings(self, model: ServableModel, settings: Settings, share: int) -> Settings:
        """The settings a model's Runtime runs with: the daemon's, on its file and its share.
        The configured drafts and chat template are the configured target's own."""
        if model.default:
            return settings.model_copy(update={"budget": share})
        return settings.model_copy(
            update={
                "target": str(model.path),
                "model_name": model.name,
                "drafts": None,
                "chat_template": None,
                "budget": share,
            }
        )

    def unload(self, name: str, why: str) -> None:
        rt = self.runtimes.pop(name, None)
        if rt is None:
            return
        st = self.stat(name)
        st.expires_at = None
        st.last_evicted_why = why
        if why == "evict":
            st.evictions += 1
            if st.served == 0:  # loaded for nothing: what the switch logic must avoid
                st.wasted += 1
                if self._on_change is not None:
                    self._on_change(name, "wasted")
        try:
            # Closed under its lock: a caller on another thread (/tokenize) finishes first.
            # The embedding context goes before: an embedding takes the lock per input.
            rt.embeddings.release()
            with rt.lock:
                rt.close()
        except Exception:  # noqa: BLE001 - the budget is given back either way
            log.exception("closing model %s failed", name)
        return_freed_memory()  # else its heap pages stay resident beside the next model
        log.info("model %s unloaded (%s)", name, why)
        self._reprice_drafts(Path(rt.settings.target))
        if len(self.runtimes) == 1:  # the one left may use the whole budget again
            (left,) = self.runtimes.values()
            try:
                left.set_budget(max(left.reserved_bytes, self._budget()))
            except BudgetExceeded:
                pass
        if self._on_change is not None:
            self._on_change(name, why)

    def close(self) -> None:
        for name in list(self.runtimes):
            rt = self.runtimes.pop(name)
            rt.close()

    # --- status ---------------------------------------------------------------------------
    def status(self, now_mono: float, now_wall: float) -> list[dict[str, Any]]:
        rows = []
        for m in self.catalog.models():
            rt = self.runtimes.get(m.name)
            st = self.stats.get(m.name, ModelStats())
            expires = None
            if rt is not None and st.expires_at is not None:
                expires = now_wall + (st.expires_at - now_mono)
            rows.append(
                {
                    "name": m.name,
                    "file": m.path.name,
                    "default": m.default,
                    "resident": rt is not None,
                    "bytes": rt.modelled_bytes() if rt is not None else 0,
                    "share_bytes": rt.budget_bytes if rt is not None else 0,
                    "expires_at": expires,  # unix seconds; None: no expiry (or not resident)
                    "loads": st.loads,
                    "loads_abandoned": st.abandoned,
                    "loads_wasted": st.wasted,
                    "evictions": st.evictions,
                    "load_s_total": round(st.load_s_total, 3),
                    # "calibrating": served plain until its costs are measured (idle time)
                    "calibration": rt.calibration if rt is not None else None,
                }
            )
        return rows
