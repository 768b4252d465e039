"""Drafts from the manifests in drafts/: ids, kinds, modelled bytes (the footprint model), loads."""

from __future__ import annotations

import dataclasses

from memspec.backends.base import Backend, BackendOptions, llama_kv_layout
from memspec.backends.shared_weights import SHARED_MODELS, weights_key
from memspec.drafts.compat import TokenizerFingerprint, check_draft
from memspec.drafts.manifest import DraftManifest
from memspec.drafts.registry import instantiate
from memspec.engine.types import Draft
from memspec.errors import ModelLoadError
from memspec.memory.footprint import Footprint, draft_footprint, on_loaded_weights
from memspec.memory.gguf_info import read_shape
from memspec.paths import models_dir


class ManifestSource:
    """The DraftSource a Runtime gives its WorkingSet. Paths resolve at call time, so a
    changed MEMSPEC_DATA_DIR or a rebuilt file is seen on the next load.

    Given the target's tokenizer, it offers only the drafts that speak it: each manifest is
    checked once, here, and an incompatible one is left out of `draft_ids()` (so no working
    set holds it and no policy can choose it); `refused` keeps each one's reason."""

    def __init__(
        self,
        manifests: dict[str, DraftManifest],
        options: BackendOptions,
        backend_kind: str,
        target: TokenizerFingerprint | None = None,
        target_backend: Backend | None = None,
    ):
        self.manifests = manifests
        # Drafts may run llama.cpp's repacked weights: only the target must be batch-invariant.
        # Only the target's features are read (by heads); only the target has sequence slots
        # (a draft serves the lead slot's sequence alone: docs/batching.md).
        # Drafts stay on this device when the target is split over RPC workers.
        self.options = dataclasses.replace(
            options,
            weight_repack=True,
            batch_invariant=False,
            features=False,
            n_seq=1,
            rpc=(),
            tensor_split=(),
            role="draft",
        )
        self.backend_kind = backend_kind
        self.target = target
        self.target_backend = target_backend  # what head drafts draft from
        reasons = {m.id: check_draft(target, m, models_dir()) for m in manifests.values()}
        # draft id -> why it cannot serve the target
        self.refused: dict[str, str] = {i: why for i, why in reasons.items() if why is not None}

    def draft_ids(self) -> list[str]:
        return [i for i in self.manifests if i not in self.refused]

    def draft_kind(self, draft_id: str) -> str:
        return self.manifests[draft_id].kind

    def footprint(self, draft_id: str) -> Footprint:
        """Its modelled bytes. A model draft whose weights a served model holds now (the 0.5B
        asked for by name while the 1.5B drafts with it) shares them: the target role pays for
        the weights, the draft for its context only (backends.shared_weights)."""
        m, o = self.manifests[draft_id], self.options
        path = m.model_path(models_dir()) if m.file else None
        fp = draft_footprint(m.kind, path, o.n_ctx, dict(m.params), o.n_gpu_layers, o.kv_cache)
        if path is not None and self.backend_kind == "llama_cpp" and path.exists():
            if SHARED_MODELS.held_as(weights_key(path, o), "target"):
                return on_loaded_weights(fp, read_shape(path))
        return fp

    def draft_bytes(self, draft_id: str) -> int:
        return self.footprint(draft_id).total

    def shares_target_kv(self, draft_id: str) -> bool:
        """Whether the draft, once loaded, copies the target's KV cache instead of catching up
        (ModelDraft.kv_donor), read off its GGUF header: a policy weighing a prefetch can count
        on it before the load."""
        m, target = self.manifests[draft_id], self.target_backend
        if m.kind != "model" or not m.file or target is None or self.backend_kind != "llama_cpp":
            return False
        layout = target.kv_layout()
        if layout is None:
            return False
        try:
            s = read_shape(m.model_path(models_dir()))
        except ModelLoadError:
            return False  # the load will say why
        kv = (s.arch, s.n_layers, s.n_head_kv, s.head_dim_k, s.head_dim_v, self.options.kv_cache)
        return layout == llama_kv_layout(*kv) and self.options.n_ctx >= target.n_ctx

    def load_draft(self, draft_id: str) -> Draft:
        return instantiate(
            self.manifests[draft_id],
            self.options,
            self.backend_kind,
            self.target,
            self.target_backend,
        )
