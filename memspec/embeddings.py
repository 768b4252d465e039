"""The embedding context one target serves embeddings from (memspec.backends.embedding):
set up on the first embedding request, charged to the budget before it is allocated, given
back on demand (Ollama's unload, or room for another model).

Built and held by the Runtime (memspec.runtime): `reserve(bytes, what)` charges its working
set (drafts evicted to make room; BudgetExceeded if the target and pinned drafts leave too
little), and a negative charge gives the bytes back.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memspec.backends.base import Backend, BackendOptions
from memspec.backends.embedding import LlamaEmbedder, plan_embedding
from memspec.config import Settings
from memspec.errors import ModelLoadError
from memspec.memory.footprint import Footprint, embedding_footprint
from memspec.memory.gguf_info import read_shape
from memspec.paths import resolve_model_path
from memspec.units import format_size

log = logging.getLogger(__name__)


class Embeddings:
    def __init__(
        self,
        settings: Callable[[], Settings],
        target: Backend,
        options: BackendOptions,
        reserve: Callable[[int, str], None],
    ):
        """`settings`: the runtime's now (a live tune may replace them); `options`: the
        target's (threads, mmap); `target`: whose loaded weights the context shares when
        settings.embedding_model is unset."""
        self._settings, self._target, self._options = settings, target, options
        self._reserve = reserve
        self._embedder: LlamaEmbedder | None = None
        self._lock = threading.Lock()
        self.footprint: Footprint | None = None  # charged while the context is set up

    def get(self) -> LlamaEmbedder:
        """The embedding context, set up on first use on settings.embedding_model, else on
        the target's loaded weights. Its footprint is charged to the budget before it is
        allocated (drafts evicted to make room): BudgetExceeded if the target and the pinned
        drafts leave too little."""
        with self._lock:
            if self._embedder is None:
                self._embedder = self._load()
            return self._embedder

    def _load(self) -> LlamaEmbedder:
        from memspec.drafts.gguf_header import open_header, scalar

        s = self._settings()
        target_path = resolve_model_path(s.target)
        path = resolve_model_path(s.embedding_model) if s.embedding_model else target_path
        if not path.is_file():
            raise ModelLoadError(f"embedding model not found: {path}", param="model")
        header = open_header(path)
        arch = scalar(header, "general.architecture") or "llama"
        keys = ("pooling_type", "context_length", "attention.causal")
        meta = {f"{arch}.{k}": scalar(header, f"{arch}.{k}") for k in keys}
        plan = plan_embedding({"general.architecture": arch, **meta}, s.n_ctx)
        # The target's own llama_model, when it is loaded in this process by llama.cpp.
        llm = getattr(self._target, "_llm", None) if path == target_path else None
        shared = getattr(llm, "_model", None)
        fp = embedding_footprint(
            read_shape(path), plan.n_ctx, plan.n_batch, shared is not None, s.n_gpu_layers
        )
        self._reserve(fp.total, f"the embedding context ({path.name}, n_ctx {plan.n_ctx})")
        try:
            emb = LlamaEmbedder(
                path,
                plan,
                shared,
                n_threads=self._options.n_threads or os.cpu_count() or 1,
                n_gpu_layers=s.n_gpu_layers,
                use_mmap=self._options.use_mmap,
            )
        except BaseException:
            self._reserve(-fp.total, "")
            raise
        self.footprint = fp
        log.info(
            "embeddings: %s, %s pooling, n_ctx %d, %s", path.name, plan.pooling_name,
            emb.n_ctx, format_size(fp.total),
        )  # fmt: skip
        return emb

    def release(self) -> bool:
        """Free the embedding context and give its bytes back (waits for an input being
        embedded). False if none was loaded."""
        with self._lock:
            emb, self._embedder = self._embedder, None
            if emb is None:
                return False
            emb.close()
            fp, self.footprint = self.footprint, None
            if fp is not None:
                self._reserve(-fp.total, "")
            return True

    def status(self) -> dict[str, Any]:
        """What status reports: loaded or not, and, loaded, its bytes by part and its setup."""
        emb, fp = self._embedder, self.footprint
        s = self._settings()
        model = s.embedding_model or s.target
        if emb is None or fp is None:
            return {"loaded": False, "model": Path(model).name}
        return {"loaded": True, **emb.describe(), "bytes": fp.to_dict()}
