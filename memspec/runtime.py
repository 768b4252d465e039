"""Assemble a target, its drafts, measured costs and acceptance estimates from settings.

Drafts live in a WorkingSet (memspec.scheduler.working_set): resident under the memory budget
(settings.budget: target + its KV and buffers, charged first, then drafts), loaded and evicted
by one background thread. Generation with draft="auto" uses what is resident now; a named
draft that is not resident is loaded reactively and the wait is reported as stall.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.config import Settings
from memspec.drafts.base import Draft
from memspec.drafts.datastore import DatastoreDraft
from memspec.drafts.manifest import (
    DEFAULT_MANIFEST_DIR,
    DraftManifest,
    check_id,
    load_manifests,
)
from memspec.drafts.registry import PRIOR_ALPHA
from memspec.engine.calibration import calibrate, measure_draft
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy, RoundPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import Generation, TokenCallback, speculative_generate
from memspec.errors import BudgetExceeded, InvalidRequest, ModelLoadError, UnknownDraft
from memspec.memory.footprint import Footprint, target_footprint
from memspec.paths import models_dir
from memspec.scheduler.manifest_source import ManifestSource
from memspec.scheduler.resident import ResidentRounds, RoundLeases
from memspec.scheduler.serving import register_policies, scheduling_status
from memspec.scheduler.working_set import WorkingSet
from memspec.units import format_size

log = logging.getLogger(__name__)


def resolve_model_path(name: str) -> Path:
    p = Path(name)
    if p.is_absolute() or p.parent != Path("."):
        return p
    return models_dir() / name


@dataclass
class PolicyRequest:
    """What a policy factory gets for one generation."""

    prompt: list[int]
    params: SamplingParams
    k: int | None  # a fixed k asked by the request (None: chosen per round)
    estimator: AcceptanceEstimator


# name -> factory(runtime, request) -> RoundPolicy. Drafts must come from
# runtime.working_set (get / acquire / lease_resident), which leases them to the engine's
# thread; the Runtime wraps every policy so the leases drop at each round boundary.
PolicyFactory = Callable[["Runtime", PolicyRequest], RoundPolicy]


def auto_policy(rt: Runtime, req: PolicyRequest) -> RoundPolicy:
    """Today's default: the decision rule over the drafts resident now (k fixed if asked)."""
    k_max = rt.settings.k_max

    def build(drafts: list[Draft]) -> RoundPolicy:
        if req.k is not None:
            return FixedPolicy(drafts[0] if drafts else None, min(req.k, k_max))
        return DecisionRulePolicy(drafts, rt.costs, req.estimator, k_max)

    return ResidentRounds(rt.working_set, build)


class Runtime:
    def __init__(self, settings: Settings, calibrate_costs: bool = True):
        self.settings = settings
        self.options = BackendOptions(
            n_ctx=settings.n_ctx,
            n_threads=settings.n_threads,
            n_gpu_layers=settings.n_gpu_layers,
            device=settings.device,
        )
        self.manifests: dict[str, DraftManifest] = load_manifests(
            settings.manifest_dir or DEFAULT_MANIFEST_DIR
        )
        self.calibrate_costs = calibrate_costs
        self.requests_per_draft: dict[str, int] = {}
        self.estimator = self.new_estimator()
        self.lock = threading.Lock()  # one decode loop at a time owns the models
        self.policies: dict[str, PolicyFactory] = {"auto": auto_policy}
        register_policies(self)  # memspec, ucb, exp3, fixed:<id>: memspec.scheduler.serving
        target_path = resolve_model_path(settings.target)
        # The target and its KV cache and buffers are charged to the budget first.
        self.target_footprint: Footprint = target_footprint(
            target_path, settings.n_ctx, settings.k_max, settings.n_gpu_layers
        )
        if self.target_footprint.total > settings.budget_bytes:
            raise BudgetExceeded(
                f"budget {format_size(settings.budget_bytes)} is below what the target needs "
                f"at n_ctx {settings.n_ctx} ({format_size(self.target_footprint.total)}); "
                "see `memspec plan --budget SIZE`",
                param="budget",
            )
        self.target: Backend = load_backend(target_path, self.options, settings.backend)
        self.draft_source = ManifestSource(self.manifests, self.options, settings.backend)
        self.working_set: WorkingSet | None = None
        try:
            # Only settings.drafts are preloaded, weightless ones included: "auto" then uses
            # exactly what the configuration names until something else is loaded.
            self.working_set = WorkingSet(
                self, settings.budget_bytes, on_loaded=self._on_draft_loaded, autoload_free=False
            )
            self._preload(settings.drafts)
            resident = list(self.drafts.values())
            self.working_set.release_leases()
            self.costs: CostModel = (
                calibrate(self.target, resident, settings.k_max)
                if calibrate_costs
                else CostModel(verify_s=[1.0] * (settings.k_max + 1))
            )
        except Exception:
            self.close()
            raise

    @property
    def reserved_bytes(self) -> int:
        return self.target_footprint.total

    def _preload(self, draft_ids: list[str]) -> None:
        """Settings.drafts, in order, as far as the budget allows (never evicting)."""
        for draft_id in draft_ids:
            self.manifest(draft_id)
            try:
                self.working_set.load(draft_id, evict=False)  # type: ignore[union-attr]
            except BudgetExceeded as e:
                log.warning("not preloading %s: %s", draft_id, e.message)
            except ModelLoadError as e:
                log.warning("draft %s failed to load: %s", draft_id, e.message)
        self.working_set.wait_idle(timeout=30.0)  # type: ignore[union-attr]

    def _on_draft_loaded(self, draft: Draft) -> None:
        """Loader thread: a draft loaded after calibration gets its cost measured once."""
        costs = getattr(self, "costs", None)
        if not self.calibrate_costs or costs is None:
            return
        if draft.id not in costs.draft_s | costs.draft_overhead_s:
            measure_draft(draft, costs, self.settings.k_max)
        else:
            draft.cost_per_token_s = costs.draft_s.get(draft.id, 0.0)

    def _sync_budget(self) -> None:
        """Follow settings.budget when it is changed in place (the admin API does that)."""
        ws = self.working_set
        if ws is None or ws.budget_bytes == self.settings.budget_bytes:
            return
        try:
            ws.budget_bytes = self.settings.budget_bytes
        except BudgetExceeded as e:
            log.warning("budget change refused: %s", e.message)

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget live (evicts to fit; BudgetExceeded if pinned drafts block)."""
        if budget_bytes < self.reserved_bytes:
            raise BudgetExceeded(
                f"budget {format_size(budget_bytes)} is below what the target needs "
                f"({format_size(self.reserved_bytes)})",
                param="budget",
            )
        self.working_set.budget_bytes = budget_bytes  # type: ignore[union-attr]
        self.settings.budget = budget_bytes

    # --- drafts -------------------------------------------------------------------------
    def manifest(self, draft_id: str) -> DraftManifest:
        check_id(draft_id)
        if draft_id not in self.manifests:
            raise UnknownDraft(
                f"unknown draft {draft_id!r}; known: {', '.join(sorted(self.manifests))}",
                param="draft",
            )
        return self.manifests[draft_id]

    @property
    def drafts(self) -> dict[str, Draft]:
        """Resident drafts, in load order, leased to the calling thread until its next
        generate() (or working_set.release_leases()): safe to use their backends meanwhile."""
        ws = self.working_set
        if ws is None:
            return {}
        return {d.id: d for d in ws.lease_resident()}

    def load_draft(self, draft_id: str) -> Draft:
        """Load now (evicting lower-value drafts if the budget needs it); retries a failed
        draft. ModelLoadError on a bad file, BudgetExceeded if pinned drafts block it."""
        self.manifest(draft_id)
        self._sync_budget()
        return self.working_set.load(draft_id)  # type: ignore[union-attr]

    def evict_draft(self, draft_id: str) -> None:
        self.manifest(draft_id)
        self.working_set.evict(draft_id)  # type: ignore[union-attr]

    def pin(self, draft_id: str, pinned: bool = True) -> None:
        self.manifest(draft_id)
        if pinned:
            self.working_set.pin(draft_id)  # type: ignore[union-attr]
        else:
            self.working_set.unpin(draft_id)  # type: ignore[union-attr]

    def draft_bytes(self, draft_id: str) -> int:
        """Modelled bytes the draft takes when resident (memspec.memory.footprint)."""
        self.manifest(draft_id)
        try:
            return self.draft_source.draft_bytes(draft_id)
        except (ModelLoadError, OSError, ValueError):
            return 0

    def draft_status(self) -> list[dict]:
        """One row per known draft: what status/admin/ctl report."""
        self._sync_budget()
        ws_rows = {r["id"]: r for r in self.working_set.status()} if self.working_set else {}
        rows = []
        for m in self.manifests.values():
            w = ws_rows.get(m.id, {})
            rows.append(
                {
                    "id": m.id,
                    "kind": m.kind,
                    "bytes": w.get("bytes", 0),
                    "resident": w.get("resident", False),
                    "pinned": w.get("pinned", False),
                    "acceptance": round(self.estimator.alpha(m.id), 4),
                    "requests": self.requests_per_draft.get(m.id, 0),
                    "tags": m.tags,
                    "state": w.get("state", "absent"),
                    "error": w.get("error"),
                    "load_s": w.get("load_s"),
                    "measured_bytes": w.get("measured_bytes"),
                }
            )
        return rows

    def modelled_bytes(self) -> int:
        """Target (weights, KV, buffers) + every draft loading, resident or evicting."""
        if self.working_set is None:
            return self.reserved_bytes
        return self.working_set.used_bytes()

    def memory_status(self) -> dict:
        """Budget, modelled use, peak, counters, and what the daemon sheds now."""
        ws = self.working_set
        out = ws.summary() if ws is not None else {"budget_bytes": self.settings.budget_bytes}
        out["target"] = self.target_footprint.to_dict()
        absent = [
            r["id"]
            for r in self.draft_status()
            if r["state"] in ("absent", "failed") and r["bytes"] > 0
        ]
        resident_models = [r for r in self.draft_status() if r["resident"] and r["bytes"] > 0]
        out["scheduling"] = scheduling_status(self)  # policy state, predictor (or why not)
        if not absent:
            out["shedding"] = "none"
        elif resident_models:
            out["shedding"] = "evicted drafts"
        else:
            out["shedding"] = "no model draft resident"
        return out

    def new_estimator(self) -> AcceptanceEstimator:
        """Acceptance estimates with a per-kind prior for every known draft."""
        est = AcceptanceEstimator()
        for m in self.manifests.values():
            est.set_prior(m.id, PRIOR_ALPHA.get(m.kind, 0.5))
        return est

    def unload_draft(self, draft_id: str) -> None:
        """Evict even if pinned."""
        ws = self.working_set
        if ws is not None:
            ws.unpin(draft_id)
            ws.evict(draft_id)

    # --- generation ---------------------------------------------------------------------
    def policy(
        self,
        draft: str = "auto",
        k: int | None = None,
        estimator: AcceptanceEstimator | None = None,
        prompt: list[int] | None = None,
        params: SamplingParams | None = None,
        policy: str | None = None,
    ) -> RoundPolicy:
        """The RoundPolicy for one request: "none", "auto" (the named policy, default
        settings.policy), or a draft id (used while resident; see generate())."""
        k_max = self.settings.k_max
        if draft == "none":
            return FixedPolicy(None, 0)
        est = estimator or self.estimator
        if draft == "auto":
            name = policy or self.settings.policy
            factory = self.policies.get(name)
            if factory is None:
                raise InvalidRequest(
                    f"unknown policy {name!r}; known: {', '.join(sorted(self.policies))}",
                    param="policy",
                )
            req = PolicyRequest(prompt or [], params or SamplingParams(), k, est)
            inner = factory(self, req)
            return inner if isinstance(inner, RoundLeases) else RoundLeases(self.working_set, inner)
        self.manifest(draft)

        def build(drafts: list[Draft]) -> RoundPolicy:
            if k is not None:
                return FixedPolicy(drafts[0] if drafts else None, min(k, k_max))
            return DecisionRulePolicy(drafts, self.costs, est, k_max)

        return ResidentRounds(self.working_set, build, ids=[draft])

    def prompt_tokens(
        self, prompt: str | None = None, messages: list[dict] | None = None
    ) -> list[int]:
        if messages is not None:
            return self.target.tokenize(
                self.target.chat_prompt(messages), add_bos=True, special=True
            )
        return self.target.tokenize(prompt or "", add_bos=True)

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        draft: str = "auto",
        k: int | None = None,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
        estimator: AcceptanceEstimator | None = None,
        policy: str | None = None,
    ) -> Generation:
        """Generate; a named draft that is not resident is loaded first (counted as stall).

        If that load fails the request decodes without it (output identical: the target
        decides every token) and the draft's status says why.
        """
        ws = self.working_set
        assert ws is not None
        self._sync_budget()
        stall0 = ws.thread_stall_s()
        with contextlib.ExitStack() as stack:
            stack.callback(ws.release_leases)
            if draft not in ("auto", "none"):
                self.manifest(draft)
                stack.enter_context(ws.holding(draft))  # not a victim while we use it
                ws.acquire(draft, wait=True)
            rp = self.policy(draft, k, estimator, prompt, params, policy)
            with self.lock:
                gen = speculative_generate(self.target, prompt, params, rp, on_token, cancel)
            finish = getattr(rp, "finish", None)
            if finish is not None:
                finish()
            # Learning datastores file this output now, not when the next request starts.
            for d in ws.lease_resident():
                if isinstance(d, DatastoreDraft) and d.learn:
                    d.finish_request(gen.token_ids)
        gen.stall_s = ws.thread_stall_s() - stall0
        for draft_id in gen.drafts_used:
            self.requests_per_draft[draft_id] = self.requests_per_draft.get(draft_id, 0) + 1
        return gen

    def close(self) -> None:
        ws, self.working_set = self.working_set, None
        if ws is not None:
            ws.close()
        target = getattr(self, "target", None)
        if target is not None:
            target.close()
