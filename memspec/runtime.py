"""Assemble a target, its drafts, measured costs and acceptance estimates from settings."""

from __future__ import annotations

import threading
from pathlib import Path

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.config import Settings
from memspec.drafts.base import Draft
from memspec.drafts.manifest import (
    DEFAULT_MANIFEST_DIR,
    DraftManifest,
    check_id,
    load_manifests,
)
from memspec.drafts.registry import PRIOR_ALPHA, instantiate
from memspec.engine.calibration import calibrate, measure_draft
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy, RoundPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import Generation, TokenCallback, speculative_generate
from memspec.errors import UnknownDraft
from memspec.paths import models_dir


def resolve_model_path(name: str) -> Path:
    p = Path(name)
    if p.is_absolute() or p.parent != Path("."):
        return p
    return models_dir() / name


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
        self.target: Backend = load_backend(
            resolve_model_path(settings.target), self.options, settings.backend
        )
        self.drafts: dict[str, Draft] = {}  # resident drafts
        self.pinned: set[str] = set()
        self.requests_per_draft: dict[str, int] = {}
        self.estimator = self.new_estimator()
        self.lock = threading.Lock()  # one decode loop at a time owns the models
        try:
            for draft_id in settings.drafts:
                self.load_draft(draft_id)
            self.costs: CostModel = (
                calibrate(self.target, list(self.drafts.values()), settings.k_max)
                if calibrate_costs
                else CostModel(verify_s=[1.0] * (settings.k_max + 1))
            )
        except Exception:
            self.close()
            raise

    # --- drafts -------------------------------------------------------------------------
    def manifest(self, draft_id: str) -> DraftManifest:
        check_id(draft_id)
        if draft_id not in self.manifests:
            raise UnknownDraft(
                f"unknown draft {draft_id!r}; known: {', '.join(sorted(self.manifests))}",
                param="draft",
            )
        return self.manifests[draft_id]

    def load_draft(self, draft_id: str) -> Draft:
        if draft_id in self.drafts:
            return self.drafts[draft_id]
        draft = instantiate(self.manifest(draft_id), self.options, self.settings.backend)
        costs = getattr(self, "costs", None)
        if costs is not None and draft_id not in costs.draft_s | costs.draft_overhead_s:
            measure_draft(draft, costs, self.settings.k_max)  # loaded after calibration
        self.drafts[draft_id] = draft
        return draft

    def evict_draft(self, draft_id: str) -> None:
        self.manifest(draft_id)
        if draft_id in self.pinned:
            from memspec.errors import InvalidRequest

            raise InvalidRequest(f"draft {draft_id!r} is pinned; unpin it first", param="draft")
        self.unload_draft(draft_id)

    def pin(self, draft_id: str, pinned: bool = True) -> None:
        self.manifest(draft_id)
        if pinned:
            self.load_draft(draft_id)
            self.pinned.add(draft_id)
        else:
            self.pinned.discard(draft_id)

    def draft_bytes(self, draft_id: str) -> int:
        """Bytes the draft takes when resident (its file; lookup drafts take ~0)."""
        m = self.manifest(draft_id)
        if m.kind != "model":
            return 0
        path = m.model_path(models_dir())
        return path.stat().st_size if path.is_file() else 0

    def draft_status(self) -> list[dict]:
        """One row per known draft: what status/admin/ctl report."""
        rows = []
        for m in self.manifests.values():
            rows.append(
                {
                    "id": m.id,
                    "kind": m.kind,
                    "bytes": self.draft_bytes(m.id),
                    "resident": m.id in self.drafts,
                    "pinned": m.id in self.pinned,
                    "acceptance": round(self.estimator.alpha(m.id), 4),
                    "requests": self.requests_per_draft.get(m.id, 0),
                    "tags": m.tags,
                }
            )
        return rows

    def modelled_bytes(self) -> int:
        """Target weights + its KV cache + resident drafts (refined by the memory model)."""
        kv = self.target.kv_bytes_per_token() * self.target.n_ctx
        return self.target.weight_bytes() + kv + sum(self.draft_bytes(d) for d in self.drafts)

    def new_estimator(self) -> AcceptanceEstimator:
        """Acceptance estimates with a per-kind prior for every known draft."""
        est = AcceptanceEstimator()
        for m in self.manifests.values():
            est.set_prior(m.id, PRIOR_ALPHA.get(m.kind, 0.5))
        return est

    def unload_draft(self, draft_id: str) -> None:
        draft = self.drafts.pop(draft_id, None)
        if draft is not None:
            draft.close()

    # --- generation ---------------------------------------------------------------------
    def policy(
        self,
        draft: str = "auto",
        k: int | None = None,
        estimator: AcceptanceEstimator | None = None,
    ) -> RoundPolicy:
        k_max = self.settings.k_max
        if draft == "none":
            return FixedPolicy(None, 0)
        if draft == "auto":
            chosen = list(self.drafts.values())
        else:
            self.manifest(draft)
            if draft not in self.drafts:
                raise UnknownDraft(f"draft {draft!r} is not loaded", param="draft")
            chosen = [self.drafts[draft]]
        if k is not None:
            return FixedPolicy(chosen[0] if chosen else None, min(k, k_max))
        return DecisionRulePolicy(chosen, self.costs, estimator or self.estimator, k_max)

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
    ) -> Generation:
        policy = self.policy(draft, k, estimator)
        with self.lock:
            gen = speculative_generate(self.target, prompt, params, policy, on_token, cancel)
        for draft_id in gen.drafts_used:
            self.requests_per_draft[draft_id] = self.requests_per_draft.get(draft_id, 0) + 1
        return gen

    def close(self) -> None:
        for draft_id in list(self.drafts):
            self.unload_draft(draft_id)
        self.target.close()
