"""The backend interface the engine speaks: batched eval with per-position logits, KV truncation.

A backend owns one model and one single-sequence KV cache. `tokens` mirrors what the KV cache
holds, so callers can reuse a shared prefix (multi-turn, draft catch-up) and roll back rejected
candidates by truncation: nothing is ever copied.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from memspec.backends.chat import ChatTemplate, resolve_chat_template
from memspec.errors import ModelLoadError
from memspec.kv_cache import F16, KVCache

GGUF_MAGIC = b"GGUF"
T = TypeVar("T")


@dataclass(frozen=True)
class BackendOptions:
    n_ctx: int = 2048
    n_threads: int | None = None  # None: all cores
    n_gpu_layers: int = 0  # CUDA/Metal offload (Jetson: -1 puts every layer on the GPU)
    use_mmap: bool = False  # False: a real load into process memory, so residency is real
    device: str = "cpu"  # torch backend only: "cpu" or "cuda"
    seed: int = 0
    chat_template: str | None = None  # settings.chat_template (memspec.backends.chat)
    # llama.cpp repacks some quantized weights (Q4_0, Q4_K, IQ4_NL...) for its CPU kernels,
    # whose batched and single-token paths sum in different orders: a position's logits then
    # depend on the batch, which breaks lossless verification. Off for a target; a draft,
    # whose output is only ever a proposal, may take the speed. A target may take it too with
    # `batch_invariant`, which routes rows so that each position always meets the same kernel.
    weight_repack: bool = False
    batch_invariant: bool = False
    # Keep the target's final hidden state (the output layer's input, after the final norm)
    # for every row eval returns: Backend.last_features(). For drafts that read the target's
    # features (issue 11's head); off, nothing extra is computed or copied.
    features: bool = False
    # Sequence slots sharing the model (batched decoding): each has a KV cache of its own of
    # n_ctx tokens (llama.cpp per-sequence streams, which keep a sequence's logits bit-identical
    # whatever else shares its batch). Backend.slots lists them; slot 0 is the backend itself.
    n_seq: int = 1
    # ggml RPC workers (HOST:PORT) the target's layers are split over, in proportion to
    # tensor_split (one weight per worker, optionally one more for this device): llama.cpp
    # only. load_backend runs such a backend in a process of its own (backends/isolated.py).
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    rpc_timeout_s: float = 30.0  # a forward pass that takes longer means a lost worker
    # What the KV cache stores K and V as, and flash attention (memspec.kv_cache): llama.cpp
    # only; the torch backend keeps its cache in the model's dtype.
    kv_cache: KVCache = F16
    # The role the model is loaded in ("target" or "draft"): llama.cpp loads share one copy of
    # a file's weights whatever the role (backends.shared_weights), and the footprint model
    # charges them to the target role.
    role: str = "target"
    share_weights: bool = True  # False: a private copy (a load's own cost is measured)


class FeaturesDisabled(RuntimeError):
    """last_features() on a backend loaded without BackendOptions.features.

    A RuntimeError, not a MemSpecError: it is a wiring bug (a draft that reads features
    attached to a target loaded without them), never a user's input or a bad file. The engine
    can catch it by this class (and drop that draft); one that escapes is a clean 500."""


@dataclass(frozen=True)
class KVSnapshot:
    """A copy of a backend's KV cache and the tokens it holds (multi-session prefix cache)."""

    tokens: tuple[int, ...]
    data: bytes
    # How many leading positions the multi-row kernels computed (the row rule: see
    # backends/llama_cpp.py), so a restored cache is extended the way a cold one would be.
    block_prefix: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.data) + 8 * len(self.tokens)


class Backend(ABC):
    """One model + one KV cache (more with BackendOptions.n_seq: `slots`). All token lists
    are plain Python ints."""

    # Capability flag: True when kv_snapshot()/kv_restore() copy the KV cache out and back in.
    # Backends without it keep the defaults below (no snapshot; restore refuses), and callers
    # fall back to plain prefix reuse.
    supports_kv_snapshot: ClassVar[bool] = False

    path: Path
    options: BackendOptions
    n_ctx: int
    n_vocab: int
    n_embd: int  # width of a features row (the hidden size the output layer reads)
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    metadata: dict[str, str]  # the GGUF's scalar keys it read (general.*, tokenizer.*), as text

    seq_id: int = 0  # which of the context's sequences this is (SequenceSlot: others)
    # Whose prompt the KV cache holds (the daemon's per-key/cache_salt partition): a request
    # of another partition never reuses it (memspec.engine.prefix_cache).
    kv_partition: str = ""
    max_batch: int = 1 << 20  # most tokens one eval_many pass may carry (llama.cpp: n_batch)

    def __init__(self) -> None:
        self.tokens: list[int] = []  # exactly what the KV cache holds, in order
        self.forward_s = 0.0  # cumulative seconds inside forward passes (engine overhead)
        self.decode_s = 0.0  # the part of forward_s in the model itself (no batch set-up, copies)
        self.argmax_s = 0.0  # the part of forward_s in eval_argmax's argmax (greedy's sampling)
        # The last eval's features rows (options.features only); _forward sets them.
        self._features: np.ndarray | None = None
        self._features_pos = 0  # the position of the token of _features' row 0
        # Chat rendering: the backend sets its BOS/EOS texts and whether its tokenizer adds BOS.
        self._chat_template: ChatTemplate | None = None
        self._bos_text = self._eos_text = ""
        self._add_bos = True

    # --- text -------------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """special=True parses control tokens (chat templates); False treats them as text."""

    @abstractmethod
    def detokenize(self, tokens: list[int]) -> bytes: ...

    @property
    def chat_template(self) -> ChatTemplate:
        """The template chats are rendered with, resolved on first use (a draft never renders
        a chat) from the setting and the GGUF's metadata (memspec.backends.chat)."""
        if self._chat_template is None:
            self._chat_template = resolve_chat_template(
                self.options.chat_template, self.metadata, self.path.name
            )
        return self._chat_template

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """Render messages (and the tools the model may call) with `chat_template`, ready for
        tokenize(add_bos=True, special=True)."""
        return self.chat_template.render(
            messages, self._bos_text, self._eos_text, self._add_bos, tools=tools
        )

    # --- compute ------------------------------------------------------------------------
    @abstractmethod
    def _forward(self, tokens: list[int], all_logits: bool, copy: bool = True) -> np.ndarray:
        """copy=False may return a view of the backend's own logits buffer (see eval).
        With options.features, also sets `_features`: one row per logits row returned."""

    @abstractmethod
    def _truncate_kv(self, n: int) -> None: ...

    def eval(self, tokens: list[int], all_logits: bool = True, copy: bool = True) -> np.ndarray:
        """Append `tokens` to the KV cache in one batch.

        Returns float32 logits of shape (len(tokens), n_vocab), or (1, n_vocab) for the last
        position only when `all_logits` is False (prefill: no logits paid for the prompt).
        copy=False may return a read-only view of the backend's buffer, valid until its next
        eval: callers that read a few rows once skip a full-vocabulary copy per row (1 MiB a
        row at a 262k vocabulary).
        """
        return self._append(tokens, all_logits, lambda: self._forward(tokens, all_logits, copy))

    def _append(self, tokens: list[int], all_logits: bool, forward: Callable[[], T]) -> T:
        """Run `forward` for `tokens` appended to the KV cache: the context check before it,
        the bookkeeping (tokens, time, features' position) after it."""
        if not tokens:
            raise ValueError("eval() needs at least one token")
        if len(self.tokens) + len(tokens) > self.n_ctx:
            from memspec.errors import ContextOverflow

            raise ContextOverflow(
                f"context of {self.n_ctx} tokens exceeded ({len(self.tokens)} + {len(tokens)})"
            )
        self._features = None  # a failed eval leaves no stale rows behind
        n_past = len(self.tokens)
        t = time.perf_counter()
        out = forward()
        self.forward_s += time.perf_counter() - t
        self.tokens.extend(tokens)
        self._features_pos = n_past if all_logits else len(self.tokens) - 1
        return out

    def last_features(self) -> np.ndarray:
        """The final hidden state (input of the output layer, after the final norm) of every
        row the last eval returned: float32 (n_rows, n_embd), row i belonging to logits row i;
        (0, n_embd) before any eval. A read-only array the backend copied out at eval time, so
        it stays valid after later evals. Raises FeaturesDisabled unless options.features."""
        if not self.options.features:
            raise FeaturesDisabled(
                f"{self.path.name} was loaded without features: load it with "
                "BackendOptions(features=True) to read its hidden states"
            )
        if self._features is None:
            return np.zeros((0, self.n_embd), dtype=np.float32)
        return self._features

    def features_at(self, position: int) -> np.ndarray | None:
        """The feature of the token at `position` of the KV cache if the last eval returned
        it (a draft reading the target's hidden state at the last verified token), else None.
        Rows of tokens truncated away since are never returned."""
        if self._features is None or position >= len(self.tokens):
            return None
        row = position - self._features_pos
        return self._features[row] if 0 <= row < len(self._features) else None

    def eval_argmax(self, tokens: list[int], drafted: list[int] | None = None) -> list[int]:
        """Append `tokens`; the argmax of every position's logits: all greedy decoding reads,
        taken from the backend's buffer without copying a row. With `drafted` (tokens[1:], the
        proposals the rows verify), the rows up to the first that disagrees (argmax_rows)."""
        return self._append(tokens, True, lambda: self._forward_argmax(tokens, drafted))

    def _forward_argmax(self, tokens: list[int], drafted: list[int] | None = None) -> list[int]:
        """_forward reduced to each row's argmax (a backend in another process sends only
        these back)."""
        logits = self._forward(tokens, True, copy=False)
        t = time.perf_counter()
        best = argmax_rows(logits, drafted)
        self.argmax_s += time.perf_counter() - t
        return best

    # --- sequence slots (batched decoding) ----------------------------------------------
    @property
    def slots(self) -> list[Backend]:
        """One Backend per sequence slot of this context; slot 0 is this backend. Each is a
        whole Backend (tokens, eval, truncate, KV snapshots) over its own KV cache."""
        return [self]

    @property
    def kv_owner(self) -> Backend:
        """The backend whose KV snapshots this one can restore (a slot's: its context's)."""
        return self

    def eval_many(self, items: list[tuple[Backend, list[int], int]]) -> list[np.ndarray]:
        """Append tokens to several slots of this context in one forward pass: items are
        (slot, tokens, rows), `rows` the number of final positions whose logits come back
        (0: none, a prefill chunk; len(tokens): all, a verification). Returns one read-only
        view per item, valid until the next eval on this context. Each slot's output is
        bit-identical to evaluating it alone (per-sequence KV streams)."""
        for slot, tokens, _ in items:
            if slot.kv_owner is not self:
                raise ValueError(f"slot {slot.seq_id} belongs to another context")
            if not tokens:
                raise ValueError("eval_many() needs at least one token per slot")
            if len(slot.tokens) + len(tokens) > self.n_ctx:
                from memspec.errors import ContextOverflow

                raise ContextOverflow(
                    f"context of {self.n_ctx} tokens exceeded ({len(slot.tokens)} + {len(tokens)})"
                )
        for slot, _, _ in items:
            slot._features = None
        n_past = [len(slot.tokens) for slot, _, _ in items]
        t = time.perf_counter()
        entries = [
            (slot.seq_id, past, tokens, rows)
            for (slot, tokens, rows), past in zip(items, n_past, strict=True)
        ]
        outs, feats = self._forward_many(entries)
        self.forward_s += time.perf_counter() - t
        for (slot, tokens, rows), f in zip(items, feats, strict=True):
            slot.tokens.extend(tokens)
            slot._features, slot._features_pos = f, len(slot.tokens) - rows
        return outs

    def _forward_many(
        self, entries: list[tuple[int, int, list[int], int]]
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """(seq_id, n_past, tokens, rows) per slot, one forward pass: logits and features
        rows per entry. Backends without slots take one entry for their only sequence."""
        if len(entries) != 1 or entries[0][0] != 0:
            raise NotImplementedError(f"{type(self).__name__} has one sequence slot")
        _, _, tokens, rows = entries[0]
        if rows not in (0, 1, len(tokens)):
            raise NotImplementedError("a backend without slots returns no row, the last or all")
        out = self._forward(tokens, all_logits=rows > 1, copy=False)
        return [out[len(out) - rows :]], [self._features if rows else None]

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of the KV cache, drop the rest (rejected candidates)."""
        if n < len(self.tokens):
            self._truncate_kv(n)
            del self.tokens[n:]

    def reuse_prefix(self, tokens: list[int]) -> int:
        """Truncate the cache to its longest common prefix with `tokens`, less what a prompt
        pass up to len(tokens) must compute again (`_reusable`); return the length kept."""
        n = self._reusable(common_prefix(self.tokens, tokens), len(tokens))
        self.truncate(n)
        return n

    def _reusable(self, n: int, end: int) -> int:
        """How many of n cached prefix tokens a prompt pass ending at `end` may keep: all,
        unless the backend's kernels give a position other bits in another batch shape."""
        return n

    def reset(self) -> None:
        self.truncate(0)

    def kv_snapshot(self) -> KVSnapshot | None:
        """Copy the KV cache (all of `tokens`) out; None when unsupported or empty."""
        return None

    # Slot support (SequenceSlot calls these on its root; backends with n_seq > 1 define them).
    def _forward_seq(
        self, seq_id: int, n_past: int, tokens: list[int], all_logits: bool, copy: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """_forward for sequence `seq_id` (prompts in chunks): logits and features rows.
        Only backends loaded with n_seq > 1 have other sequences (llama.cpp's)."""
        raise NotImplementedError(f"{type(self).__name__} has no sequence slots beyond its own")

    def _truncate_seq(self, seq_id: int, n: int) -> None:
        """Truncate sequence `seq_id` (slots of a backend loaded with n_seq > 1)."""
        raise NotImplementedError(f"{type(self).__name__} has no sequence slots beyond its own")

    def _snapshot_seq(self, seq_id: int, tokens: list[int]) -> KVSnapshot | None:
        return None

    def _restore_seq(self, seq_id: int, snapshot: KVSnapshot) -> bool:
        return False

    def kv_restore(self, snapshot: KVSnapshot) -> bool:
        """Replace the KV cache by `snapshot`; False (cache left empty or as it was) if it fails."""
        return False

    def kv_layout(self) -> tuple[object, ...] | None:
        """What one token's KV cache is made of (engine, architecture, layers, KV heads, head
        sizes). Two backends of one layout can load each other's snapshots cheaply (a
        self-draft takes the target's prompt KV instead of computing its own); None: not
        such a backend (no snapshots, or a snapshot that would cross a process or a link)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the model and its KV cache."""

    def describe(self) -> dict[str, object]:
        """What determines this backend's speed (calibration cache key). Backends add
        `batch_invariant`: whether a position's logits are bit-identical in any batch shape,
        which makes greedy speculative output bit-for-bit plain decoding's."""
        out: dict[str, object] = {"backend": type(self).__name__, "file": self.path.name}
        if self.options.features:  # extra output rows and copies: part of the verify cost
            out["features"] = True
        return out

    # --- memory -------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return self.path.stat().st_size

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per token (both K and V, all layers)."""
        return 0


class SequenceContext(Backend):
    """A backend over one context of sequences whose primitives take a sequence id
    (`_forward_seq`, `_truncate_seq`, `_snapshot_seq`, `_restore_seq`: llama.cpp, in this
    process or its own): the backend itself is sequence 0, `slots` the rest."""

    supports_kv_snapshot = True
    _slots: list[Backend]

    @property
    def slots(self) -> list[Backend]:
        return self._slots

    def _forward(self, tokens: list[int], all_logits: bool, copy: bool = True) -> np.ndarray:
        logits, self._features = self._forward_seq(0, len(self.tokens), tokens, all_logits, copy)
        return logits

    def _truncate_kv(self, n: int) -> None:
        self._truncate_seq(0, n)

    def _reusable(self, n: int, end: int) -> int:
        return self._reusable_seq(0, n, end)

    def _reusable_seq(self, seq_id: int, n: int, end: int) -> int:
        """_reusable for sequence `seq_id`."""
        return n

    def kv_snapshot(self) -> KVSnapshot | None:
        return self._snapshot_seq(0, self.tokens)

    def kv_restore(self, snapshot: KVSnapshot) -> bool:
        self._features = None  # rows of the tokens being replaced
        ok = self._restore_seq(0, snapshot)
        self.tokens = list(snapshot.tokens) if ok else []
        return ok


class SequenceSlot(Backend):
    """Sequence `seq_id` of a multi-sequence backend's context: its own tokens and KV cache,
    the model, tokenizer and metadata of its root (slot 0), which does the compute."""

    def __init__(self, root: Backend, seq_id: int):
        super().__init__()
        self.root, self.seq_id = root, seq_id
        self.supports_kv_snapshot = root.supports_kv_snapshot  # type: ignore[misc]
        self.path, self.options, self.metadata = root.path, root.options, root.metadata
        self.n_ctx, self.n_vocab, self.n_embd = root.n_ctx, root.n_vocab, root.n_embd
        self.bos_token_id, self.eos_token_ids = root.bos_token_id, root.eos_token_ids
        self._bos_text, self._eos_text = root._bos_text, root._eos_text
        self._add_bos = root._add_bos

    @property
    def kv_owner(self) -> Backend:
        return self.root

    @property
    def chat_template(self) -> ChatTemplate:
        return self.root.chat_template

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.root.tokenize(text, add_bos, special)

    def detokenize(self, tokens: list[int]) -> bytes:
        return self.root.detokenize(tokens)

    def _forward(self, tokens: list[int], all_logits: bool, copy: bool = True) -> np.ndarray:
        logits, self._features = self.root._forward_seq(
            self.seq_id, len(self.tokens), tokens, all_logits, copy
        )
        return logits

    def _truncate_kv(self, n: int) -> None:
        self.root._truncate_seq(self.seq_id, n)

    def _reusable(self, n: int, end: int) -> int:
        return self.root._reusable_seq(self.seq_id, n, end)  # type: ignore[attr-defined]

    def kv_snapshot(self) -> KVSnapshot | None:
        return self.root._snapshot_seq(self.seq_id, self.tokens)

    def kv_restore(self, snapshot: KVSnapshot) -> bool:
        self._features = None
        ok = self.root._restore_seq(self.seq_id, snapshot)
        self.tokens = list(snapshot.tokens) if ok else []
        return ok

    def describe(self) -> dict[str, object]:
        return self.root.describe()

    def weight_bytes(self) -> int:
        return 0  # the root's

    def kv_bytes_per_token(self) -> int:
        return self.root.kv_bytes_per_token()


def llama_kv_layout(
    arch: str,
    n_layers: int,
    n_kv_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    kv: KVCache = F16,
) -> tuple[object, ...]:
    """A llama.cpp model's Backend.kv_layout, from its GGUF hyper-parameters (which a header
    read gives before any load) and its cache types (a q8_0 cache cannot take f16 rows)."""
    return ("llama.cpp", arch, n_layers, n_kv_heads, head_dim_k, head_dim_v, kv.type_k, kv.type_v)


def argmax_rows(logits: np.ndarray, drafted: list[int] | None = None) -> list[int]:
    """Each row's argmax, read in place. With `drafted` (row i verifies drafted[i]), only the
    rows up to the first whose argmax disagrees, that one included: greedy verification keeps
    nothing after it, and each row read is a pass over the whole vocabulary."""
    if not drafted:
        return logits.argmax(axis=1).tolist()
    best: list[int] = []
    for i in range(len(logits)):
        best.append(int(logits[i].argmax()))
        if i >= len(drafted) or best[i] != drafted[i]:
            break
    return best


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """Length of the longest common prefix, by slice comparisons (C speed; called per round)."""
    if type(a) is not type(b):  # a list never equals a tuple slice
        a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_gguf(path: str | os.PathLike[str]) -> Path:
    """Fail early and clearly on a missing, empty, or non-GGUF file."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {p}", param="model")
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {p}", param="model")
    return p


def load_backend(
    path: str | os.PathLike[str], options: BackendOptions | None = None, kind: str = "llama_cpp"
) -> Backend:
    """Load a model file with the named backend ("llama_cpp" or "torch")."""
    options = options or BackendOptions()
    p = check_gguf(path)
    if kind == "llama_cpp":
        if options.rpc:  # ggml aborts the process that loses a worker: keep it out of ours
            from memspec.backends.isolated import IsolatedBackend

            return IsolatedBackend(p, options)
        from memspec.backends.llama_cpp import LlamaCppBackend

        return LlamaCppBackend(p, options)
    if kind == "torch":
        if options.rpc:
            raise ModelLoadError("rpc workers need the llama_cpp backend", param="rpc")
        from memspec.backends.torch_hf import TorchBackend

        return TorchBackend(p, options)
    raise ValueError(f"unknown backend {kind!r} (llama_cpp or torch)")
