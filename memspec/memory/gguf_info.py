"""A GGUF model's hyper-parameters and tensor bytes, read with the `gguf` package (no load).

Only the header is parsed, by memspec.drafts.gguf_header's reader (array fields kept as raw
bytes: a 262k-token vocabulary reads in a tenth of a second; its tokenizer fields are read
there too). Results are cached per (path, size, mtime), since plans and budgets ask repeatedly.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from memspec.drafts.gguf_header import open_header
from memspec.drafts.gguf_header import scalar as _scalar
from memspec.errors import ModelLoadError
from memspec.kv_cache import sliding_window


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about one GGUF model."""

    path: Path
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    weight_bytes: int  # Σ tensor bytes: what llama.cpp allocates for the weights (mmap off)
    file_bytes: int
    tied_output: bool  # no output.weight: the output layer reuses token_embd
    token_embd_bytes: int
    bytes_by_type: dict[str, int] = field(default_factory=dict)
    # Sliding-window attention (Gemma 2/3): the window in tokens, and how many layers have it
    # (the others attend to the whole context). 0: none.
    n_swa: int = 0
    swa_layers: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, f16 cache (llama.cpp's default type_k/type_v)."""
        return self.n_layers * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * 2

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["path"] = str(self.path)
        d["kv_bytes_per_token"] = self.kv_bytes_per_token
        return d


def _read(path: Path) -> ModelShape:
    r = open_header(path)
    arch = _scalar(r, "general.architecture") or "llama"

    def hp(name: str, default: int | None = None) -> int:
        v = _scalar(r, f"{arch}.{name}")
        if v is None:
            if default is None:
                raise ModelLoadError(f"{path.name}: missing {arch}.{name}", param="model")
            return default
        return int(v)

    n_embd = hp("embedding_length")
    n_head = hp("attention.head_count")
    n_head_kv = hp("attention.head_count_kv", n_head)
    head_dim = n_embd // max(n_head, 1)
    n_vocab = _scalar(r, f"{arch}.vocab_size") or _scalar(r, "tokenizer.ggml.tokens") or 0
    by_type: dict[str, int] = {}
    names = set()
    embd_bytes = 0
    for t in r.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
        names.add(t.name)
        if t.name == "token_embd.weight":
            embd_bytes = int(t.n_bytes)
    n_layers = hp("block_count")
    n_swa, swa_layers = _sliding_window(r, arch, n_layers)
    return ModelShape(
        path=path,
        arch=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=hp("attention.key_length", head_dim),
        head_dim_v=hp("attention.value_length", head_dim),
        n_ff=hp("feed_forward_length", 4 * n_embd),
        n_vocab=int(n_vocab),
        weight_bytes=sum(by_type.values()),
        file_bytes=path.stat().st_size,
        tied_output="output.weight" not in names,
        token_embd_bytes=embd_bytes,
        bytes_by_type=by_type,
        n_swa=n_swa,
        swa_layers=swa_layers,
    )


def _sliding_window(r: Any, arch: str, n_layers: int) -> tuple[int, int]:
    """(window, layers with it) as llama.cpp loads them (kv_cache.sliding_window)."""
    key = f"{arch}.attention.sliding_window_pattern"
    field = r.fields.get(key)
    pattern = None if field is None else field.types[0] != GGUFValueType.ARRAY or "array"
    period = _scalar(r, key) if pattern is True else pattern
    window = _scalar(r, f"{arch}.attention.sliding_window")
    return sliding_window(arch, n_layers, window, period)


_cache: dict[tuple[str, int, int], ModelShape] = {}
_cache_lock = threading.Lock()


def read_shape(path: str | os.PathLike[str]) -> ModelShape:
    """Hyper-parameters of a GGUF file; ModelLoadError if it is missing or unreadable."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ModelLoadError(f"model file not found: {p}", param="model") from e
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    shape = _read(p)
    with _cache_lock:
        _cache[key] = shape
    return shape
