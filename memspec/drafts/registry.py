"""Turn a validated manifest into a live Draft (one place that knows every draft kind)."""

from __future__ import annotations

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.drafts.compat import TokenizerFingerprint, require_compatible
from memspec.drafts.manifest import DraftManifest
from memspec.drafts.model import ModelDraft
from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.types import Draft
from memspec.errors import ModelLoadError
from memspec.paths import models_dir

# α before any round has been seen, per kind (the estimator moves off it within a request).
PRIOR_ALPHA = {"model": 0.7, "prompt_lookup": 0.4, "datastore": 0.4, "head": 0.5}


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
