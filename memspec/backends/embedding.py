"""Embeddings from llama.cpp's embedding mode, in a llama context of their own.

The context sits on the target's loaded llama_model when the target serves embeddings (the
weights are held once; llama.cpp allows several contexts over one model, which is read-only
once loaded), else on a model this module loads. It never shares the target's context: that
one holds the sequences the engine decodes, its batch and its output buffers, so an
embedding pass there would race the engine's rounds. The caller passes the lock the engine
decodes under; every chunk of an embedding takes it, so embeddings and rounds alternate
(neither waits longer than one chunk of the other, and they never fight over the cores).

Pooling is the model's own: `<arch>.pooling_type` from the GGUF (mean, cls, last). A
generative model (SmolLM2, Qwen, Gemma) has none; it gets last-token pooling, the
final-normed hidden state of the input's last token. That is what Ollama's llama runner
returned for such a model (no pooled row without pooling, so it took the embedding of the
batch's last token, GetEmbeddingsIth) and how llama.cpp pools decoder embedding models
(LLAMA_POOLING_TYPE_LAST); llama-server refuses pooling "none" on /v1/embeddings.

In embeddings mode llama.cpp outputs every token of a batch, logits (a vocabulary of floats)
and features (n_embd floats) alike, so its output buffer is n_batch rows of both. A causal
model pooled on its last token therefore runs in chunks of EMBED_BATCH tokens (its KV cache
carries the context from chunk to chunk; the last chunk's pooled row is the answer). Pooling
that reads every token (mean, cls), and non-causal models, need the whole input in one ubatch.

Vectors come back raw (the model's pooled output); `l2_normalize` and `shorten` are what the
routes apply (Ollama normalises /api/embed, and `dimensions` cuts then normalises again).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memspec.errors import ModelLoadError

# Tokens per decode for a causal model pooled on its last token: its output buffer holds this
# many rows of logits and features (SmolLM2: 128 × (49,152 + 576) × 4 bytes = 25 MB).
EMBED_BATCH = 128

# llama.cpp's enum llama_pooling_type.
POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST, POOLING_RANK = 0, 1, 2, 3, 4
POOLING_NAMES = {POOLING_MEAN: "mean", POOLING_CLS: "cls", POOLING_LAST: "last"}


class EmbedderClosed(RuntimeError):
    """The embedding context was released (a reload, keep_alive 0) while a request held it."""


@dataclass(frozen=True)
class EmbeddingPlan:
    """How a model's embedding context is set up, from its GGUF header alone (the footprint
    is charged before anything is allocated)."""

    pooling: int  # POOLING_MEAN / CLS / LAST
    from_model: bool  # the GGUF names the pooling (else last-token, the default above)
    causal: bool
    n_ctx: int  # tokens an input may have
    n_batch: int  # tokens per decode (and rows of llama.cpp's output buffer)

    @property
    def pooling_name(self) -> str:
        return POOLING_NAMES[self.pooling]

    def describe(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling_name,
            "pooling_source": "model" if self.from_model else "last-token default",
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
        }


def _as_bool(v: Any, default: bool) -> bool:
    if v is None:
        return default
    if isinstance(v, str):
        return v.strip().lower() not in ("false", "0", "")
    return bool(v)


def plan_embedding(meta: Mapping[str, Any], n_ctx: int) -> EmbeddingPlan:
    """The context for a model whose GGUF metadata is `meta` (values as the header holds them,
    or as strings, as llama-cpp-python's metadata has them), at most `n_ctx` tokens an input
    (never beyond the model's trained context)."""
    arch = str(meta.get("general.architecture", "llama"))
    raw = meta.get(f"{arch}.pooling_type")
    pooling = int(raw) if raw is not None else POOLING_NONE
    if pooling == POOLING_RANK:
        raise ModelLoadError(
            "the embedding model is a reranker (pooling rank): it scores pairs, it does not "
            "embed; set embedding_model to an embedding or generative model",
            param="model",
        )
    from_model = pooling in POOLING_NAMES
    if not from_model:
        pooling = POOLING_LAST
    trained = meta.get(f"{arch}.context_length")
    if trained is not None and int(trained) > 0:
        n_ctx = min(n_ctx, int(trained))
    causal = _as_bool(meta.get(f"{arch}.attention.causal"), True)
    whole = pooling != POOLING_LAST or not causal  # every token in one ubatch
    return EmbeddingPlan(
        pooling, from_model, causal, n_ctx, n_ctx if whole else min(n_ctx, EMBED_BATCH)
    )


def l2_normalize(vec: np.ndarray) -> np.ndarray:
    """Unit length, as Ollama's normalize(): a zero vector stays zero; NaN or Inf is an error
    (the model's output is broken, not the request)."""
    v = np.asarray(vec, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError("embedding contains NaN or Inf values")
    return (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)


def shorten(vec: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` components, normalised again (Matryoshka-style, as Ollama's
    `dimensions`); None or at least the vector's length: unchanged."""
    if dimensions is None or dimensions >= len(vec):
        return vec
    return l2_normalize(vec[:dimensions])


class LlamaEmbedder:
    """One llama context in embeddings mode, one input at a time (sequence 0, cleared between).

    `model`: the target's loaded llama_cpp._internals.LlamaModel to share, or None to load
    `path` (its weights are then this embedder's own)."""

    def __init__(
        self,
        path: Path,
        plan: EmbeddingPlan,
        model: Any | None = None,
        *,
        n_threads: int,
        n_gpu_layers: int = 0,
        use_mmap: bool = False,
    ):
        import llama_cpp
        from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

        # The target's loader swaps llama.cpp's default parameters while it loads (its lock).
        from memspec.backends.llama_cpp import _params_lock

        self.path = path
        self.plan = plan
        self.shares_weights = model is not None
        self._lock = threading.Lock()  # one input at a time through the context
        self._own_model: Any | None = None
        log = io.StringIO()
        try:
            with contextlib.redirect_stderr(log), _params_lock:
                if model is None:
                    mp = llama_cpp.llama_model_default_params()
                    mp.n_gpu_layers = n_gpu_layers
                    mp.use_mmap = use_mmap
                    model = self._own_model = LlamaModel(
                        path_model=str(path), params=mp, verbose=False
                    )
                cp = llama_cpp.llama_context_default_params()
                cp.n_ctx = plan.n_ctx
                cp.n_batch = cp.n_ubatch = plan.n_batch
                cp.n_seq_max = 1
                cp.n_threads = cp.n_threads_batch = n_threads
                cp.embeddings = True
                cp.pooling_type = plan.pooling
                self._ctx = LlamaContext(model=model, params=cp, verbose=False)
            self._batch = LlamaBatch(n_tokens=plan.n_batch, embd=0, n_seq_max=1, verbose=False)
        except Exception as e:  # llama.cpp reports failures as bare ValueErrors
            self._close_native()
            raise ModelLoadError(
                f"failed to set up embeddings on {path.name}: {e}", param="model"
            ) from e
        self._model = model
        self.n_ctx = min(plan.n_ctx, self._ctx.n_ctx())  # llama.cpp may round the context up
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(model.model))
        self._add_eos = bool(model.add_eos_token())
        self._closed = False

    # --- text ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """The model's tokens for `text`, with the special tokens its tokenizer adds (BOS, and
        EOS or SEP where the GGUF asks for them)."""
        return self._model.tokenize(text.encode("utf-8"), True, False)

    def fit(self, text: str, limit: int) -> tuple[list[int], bool]:
        """`text`'s tokens cut to `limit` at the end of the text, keeping the special tokens
        around it (as Ollama truncates: a shorter text, tokenized again). (tokens, cut)."""
        full = self.tokenize(text)
        if len(full) <= limit:
            return full, False
        body = self._model.tokenize(text.encode("utf-8"), False, False)
        n_tail = 1 if self._add_eos else 0
        n_head = len(full) - len(body) - n_tail
        head, tail = full[:n_head], full[len(full) - n_tail :]
        if n_head < 0 or head + body + tail != full:  # not the layout expected: cut plainly
            return full[:limit], True
        room = limit - n_head - n_tail
        if room <= 0:
            raise ValueError("the context cannot hold even the special tokens")
        return head + body[:room] + tail, True

    @property
    def n_vocab(self) -> int:
        import llama_cpp

        return int(llama_cpp.llama_vocab_n_tokens(self._model.vocab))

    # --- compute ------------------------------------------------------------------------
    def embed(self, tokens: list[int], engine_lock: AbstractContextManager[Any]) -> np.ndarray:
        """The pooled embedding of `tokens` (at most n_ctx of them), raw: not normalised.
        Each decode runs under `engine_lock` (between the engine's rounds)."""
        import llama_cpp

        if not tokens:
            raise ValueError("nothing to embed")
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens exceed the embedding context ({self.n_ctx})")
        with self._lock:
            if self._closed:
                raise EmbedderClosed("the embedding context was released")
            if self._ctx.memory is not None:  # non-causal models keep no cache
                llama_cpp.llama_memory_clear(self._ctx.memory, False)
            b = self._batch.batch
            for start in range(0, len(tokens), self.plan.n_batch):
                chunk = tokens[start : start + self.plan.n_batch]
                for i, tok in enumerate(chunk):
                    b.token[i] = tok
                    b.pos[i] = start + i
                    b.seq_id[i][0] = 0
                    b.n_seq_id[i] = 1
                    b.logits[i] = True  # embeddings mode outputs every token anyway
                b.n_tokens = len(chunk)
                with engine_lock:
                    self._ctx.decode(self._batch)
            ptr = llama_cpp.llama_get_embeddings_seq(self._ctx.ctx, 0)
            if not ptr:
                raise RuntimeError("llama.cpp returned no pooled embedding")
            out = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_embd,)
            )
            return out.copy()

    def close(self) -> None:
        """Free the context (and the model, if it is this embedder's own); waits for an input
        being embedded."""
        with self._lock:
            self._closed = True
            self._close_native()

    def _close_native(self) -> None:
        for name in ("_batch", "_ctx", "_own_model"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.path.name,
            "shares_target_weights": self.shares_weights,
            "n_embd": self.n_embd,
            **self.plan.describe(),
            "n_ctx": self.n_ctx,
        }
