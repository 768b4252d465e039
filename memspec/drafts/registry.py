"""Every draft kind: what the rest of the package needs to know of it, and how a validated
manifest becomes a live Draft. The one place that knows the kinds: memory sizing
(memspec.memory.footprint), measuring (memspec.memory.probe) and the runtime's preload ask
`draft_kind()` instead of naming kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.drafts.compat import TokenizerFingerprint, require_compatible
from memspec.drafts.manifest import DraftManifest
from memspec.drafts.model import ModelDraft
from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.types import Draft
from memspec.errors import ModelLoadError
from memspec.paths import models_dir

# How a kind's memory is modelled (memspec.memory.footprint.draft_footprint): "gguf" a model
# file (weights, KV, logit rows), "head" its float16 tensors, "file" what its file holds once
# read, "none" nothing beyond the context.
Sizing = Literal["gguf", "head", "file", "none"]


@dataclass(frozen=True)
class DraftKind:
    name: str
    prior_alpha: float  # α before any round has been seen (the estimator moves off it)
    sizing: Sizing
    # A model of weights: preloaded after the light kinds, smallest first (Runtime).
    weighty: bool = False
    # Drafts from the target's hidden states: loads only beside a target that exposes them.
    needs_target_features: bool = False

    @property
    def has_file(self) -> bool:
        """Its weights or data are a file (the manifest must name it)."""
        return self.sizing != "none"


KINDS: dict[str, DraftKind] = {
    k.name: k
    for k in (
        DraftKind("model", 0.7, "gguf", weighty=True),
        DraftKind("prompt_lookup", 0.4, "none"),
        DraftKind("datastore", 0.4, "file"),
        DraftKind("head", 0.5, "head", weighty=True, needs_target_features=True),
    )
}
UNKNOWN_KIND = DraftKind("unknown", 0.5, "file")  # a kind of a newer manifest: sized by file

# α before any round has been seen, per kind.
PRIOR_ALPHA = {name: k.prior_alpha for name, k in KINDS.items()}


def draft_kind(name: str) -> DraftKind:
    """What the package knows of a draft kind (UNKNOWN_KIND for a name it does not know)."""
    return KINDS.get(name, UNKNOWN_KIND)


def instantiate(
    m: DraftManifest,
    options: BackendOptions,
    backend_kind: str,
    target: TokenizerFingerprint | None = None,
    target_backend: Backend | None = None,
) -> Draft:
    """Load the draft a manifest describes. Raises ModelLoadError for a bad/missing file and,
    given the target's tokenizer, DraftIncompatible for a draft that speaks another. A head
    drafts from `target_backend`'s features (loaded with them)."""
    if target is not None:  # a file rebuilt since the runtime checked it is checked again
        require_compatible(target, m, models_dir())
    if m.kind == "prompt_lookup":
        return PromptLookupDraft(
            m.id, int(m.params.get("max_ngram", 3)), int(m.params.get("min_ngram", 1))
        )
    if m.kind == "datastore":
        from memspec.drafts.datastore import load_datastore

        return load_datastore(m.id, m.model_path(models_dir()), dict(m.params))
    if m.kind == "head":
        if target_backend is None:
            raise ModelLoadError(f"draft {m.id}: a head drafts from a loaded target", param="draft")
        from memspec.drafts.head import HeadDraft

        return HeadDraft(m.id, m.model_path(models_dir()), target_backend, options.device)
    if m.kind == "model":
        backend = load_backend(m.model_path(models_dir()), options, backend_kind)
        return ModelDraft(m.id, backend, kv_donor=target_backend)  # kept if layouts match
    raise ValueError(f"draft {m.id}: unsupported kind {m.kind!r}")
