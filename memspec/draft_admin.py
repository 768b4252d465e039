"""One target's drafts as requests and the admin API name them: which exist, which this target
can use, and the admin's actions on them (load, evict, pin, unload), with one status row each.

Built and held by the Runtime (memspec.runtime); the working set it acts on is the runtime's
(memspec.scheduler.working_set), asked for at each call: a closed runtime has none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from memspec.drafts.compat import incompatible_error
from memspec.drafts.family import skipped_error
from memspec.drafts.manifest import DraftManifest, check_id
from memspec.engine.costs import AcceptanceEstimator
from memspec.engine.types import Draft
from memspec.errors import ModelLoadError, UnknownDraft
from memspec.scheduler.draft_choice import DraftAsk
from memspec.scheduler.manifest_source import ManifestSource
from memspec.scheduler.working_set import WorkingSet


class DraftAdmin:
    def __init__(
        self,
        manifests: dict[str, DraftManifest],
        skipped: dict[str, str],
        source: ManifestSource,
        working_set: Callable[[], WorkingSet | None],
        estimator: AcceptanceEstimator,
    ):
        """`skipped`: recipes the target's family skipped (e.g. a Q4 self-draft of a Q4
        target), with the reason: named in settings.drafts they are passed over, named in a
        request refused. `working_set`: the runtime's now (None once it is closed)."""
        self.manifests, self.skipped, self.source = manifests, skipped, source
        self._working_set, self.estimator = working_set, estimator
        self.requests_per_draft: Counter[str] = Counter()  # requests that used each draft

    def _ws(self) -> WorkingSet:
        ws = self._working_set()
        if ws is None:
            raise RuntimeError("the runtime is closed")
        return ws

    def manifest(self, draft_id: str) -> DraftManifest:
        check_id(draft_id)
        if draft_id in self.skipped and draft_id not in self.manifests:
            raise skipped_error(draft_id, self.skipped[draft_id])
        if draft_id not in self.manifests:
            raise UnknownDraft(
                f"unknown draft {draft_id!r}; known: {', '.join(sorted(self.manifests))}",
                param="draft",
            )
        return self.manifests[draft_id]

    def draft_ask(self, draft: str) -> DraftAsk:
        """A request's `draft` field decoded; a named draft is checked before anything runs
        (unknown: 404, incompatible: 400)."""
        ask = DraftAsk.parse(draft)
        if ask.named is not None:
            self.usable(ask.named)
        return ask

    @property
    def incompatible(self) -> dict[str, str]:
        """Drafts that speak another tokenizer than the target, with the reason."""
        return self.source.refused

    def usable(self, draft_id: str) -> DraftManifest:
        """The manifest of a draft this target can use: UnknownDraft, or DraftIncompatible."""
        m = self.manifest(draft_id)
        reason = self.incompatible.get(draft_id)
        if reason is not None:
            raise incompatible_error(draft_id, reason)
        return m

    def load_draft(self, draft_id: str) -> Draft:
        """Load now (evicting lower-value drafts if the budget needs it); retries a failed
        draft. ModelLoadError on a bad file, BudgetExceeded if pinned drafts block it,
        DraftIncompatible if it speaks another tokenizer."""
        self.usable(draft_id)
        return self._ws().load(draft_id)

    def evict_draft(self, draft_id: str) -> None:
        if self.manifest(draft_id).id not in self.incompatible:  # never loaded: evicted already
            self._ws().evict(draft_id)

    def pin(self, draft_id: str, pinned: bool = True) -> None:
        if pinned:
            self.usable(draft_id)
            self._ws().pin(draft_id)
        elif self.manifest(draft_id).id not in self.incompatible:  # those are never pinned
            self._ws().unpin(draft_id)

    def unload_draft(self, draft_id: str) -> None:
        """Evict even if pinned."""
        ws = self._working_set()
        if ws is not None and draft_id not in self.incompatible:
            ws.unpin(draft_id)
            ws.evict(draft_id)

    def draft_bytes(self, draft_id: str) -> int:
        """Modelled bytes the draft takes when resident (memspec.memory.footprint)."""
        self.manifest(draft_id)
        try:
            return self.source.draft_bytes(draft_id)
        except (ModelLoadError, OSError, ValueError):
            return 0

    def draft_status(self) -> list[dict]:
        """One row per known draft: what status/admin/ctl report."""
        ws = self._working_set()
        ws_rows = {r["id"]: r for r in ws.status()} if ws is not None else {}
        rows = []
        for m in self.manifests.values():
            w = ws_rows.get(m.id, {})
            reason = self.incompatible.get(m.id)
            rows.append(
                {
                    "id": m.id,
                    "kind": m.kind,
                    "bytes": w.get("bytes", 0),
                    "resident": w.get("resident", False),
                    "pinned": w.get("pinned", False),
                    "acceptance": round(self.estimator.alpha(m.id), 4),
                    # The policy's last plan: what holding it is predicted to be worth.
                    "value": round(float(w.get("value") or 0.0), 6),
                    "requests": self.requests_per_draft.get(m.id, 0),
                    "tags": m.tags,
                    "state": w.get("state", "absent"),
                    "error": w.get("error"),
                    "load_s": w.get("load_s"),
                    "measured_bytes": w.get("measured_bytes"),
                    "compatible": reason is None,  # speaks the target's tokenizer
                    "reason": reason,
                }
            )
        return rows
