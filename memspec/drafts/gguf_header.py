"""A GGUF file's header, read with the `gguf` package without loading the model.

GGUFReader turns every element of every array field into its own numpy view, which for a
tokenizer (49k tokens and 49k merges, or Gemma's 262k tokens) takes seconds; `HeaderReader`
keeps an array field as its raw bytes instead and parses everything else as GGUFReader does.

It lives here, below both users, because memspec.memory (model shapes) imports memspec.drafts,
and the drafts need the tokenizer fields (memspec.drafts.compat) without importing memory.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from memspec.errors import ModelLoadError

# Byte sizes of GGUF scalar types (the gguf spec), for skipping arrays without parsing them.
_SCALAR_SIZE = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


class HeaderReader(GGUFReader):
    """GGUFReader that keeps an array field as [item type, length, raw bytes] (fast)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + 12
        itype = GGUFValueType(int(raw_itype[0]))
        n = int(alen[0])
        if itype in _SCALAR_SIZE:
            offs += n * _SCALAR_SIZE[itype]
        elif itype == GGUFValueType.STRING:
            buf = memoryview(self.data)
            for _ in range(n):  # each string: u64 length, then the bytes
                offs += 8 + struct.unpack_from("<Q", buf, offs)[0]
        else:  # nested arrays: rare in practice; let GGUFReader walk them
            return super()._get_field_parts(orig_offs, raw_type)
        blob = self._get(orig_offs + 12, np.uint8, offs - orig_offs - 12)
        return offs - orig_offs, [raw_itype, alen, blob], [1], [GGUFValueType.ARRAY, itype]


def open_header(path: Path) -> HeaderReader:
    """The header of a GGUF file; ModelLoadError if it is missing or unreadable."""
    try:
        return HeaderReader(path)
    except FileNotFoundError as e:
        raise ModelLoadError(f"model file not found: {path}", param="model") from e
    except Exception as e:  # truncated or garbage headers surface as assorted numpy errors
        raise ModelLoadError(f"cannot read GGUF header of {path.name}: {e}", param="model") from e


def scalar(reader: GGUFReader, key: str) -> Any:
    """A field's value: a string, a number, or for an array its length. None if absent."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    part = f.parts[f.data[0]]
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return int(part[0])  # HeaderReader's data index is the array's length
    return part.tolist()[0]


def array_bytes(reader: HeaderReader, key: str) -> bytes | None:
    """The raw bytes of an array field as stored (strings: u64 length, then the bytes)."""
    f = reader.fields.get(key)
    if f is None or not f.types or f.types[0] != GGUFValueType.ARRAY:
        return None
    return bytes(f.parts[-1])


@dataclass(frozen=True)
class TokenizerFields:
    """What decides whether two models speak the same token ids (tokenizer.ggml.*)."""

    model: str | None  # tokenizer.ggml.model: "gpt2" (BPE), "llama" (SentencePiece), ...
    n_tokens: int
    tokens_sha256: str  # of the raw bytes of tokenizer.ggml.tokens
    token_types_sha256: str  # of the raw bytes of tokenizer.ggml.token_type ("" if absent)
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    add_eos: bool | None


def _sha(blob: bytes | None) -> str:
    return hashlib.sha256(blob).hexdigest() if blob is not None else ""


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_bool(v: Any) -> bool | None:
    return None if v is None else bool(v)


def _tokenizer_fields(path: Path) -> TokenizerFields | None:
    r = open_header(path)
    tokens = array_bytes(r, "tokenizer.ggml.tokens")
    if tokens is None:
        return None
    return TokenizerFields(
        model=scalar(r, "tokenizer.ggml.model"),
        n_tokens=int(scalar(r, "tokenizer.ggml.tokens")),
        tokens_sha256=_sha(tokens),
        token_types_sha256=_sha(array_bytes(r, "tokenizer.ggml.token_type")),
        bos_id=_opt_int(scalar(r, "tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(scalar(r, "tokenizer.ggml.eos_token_id")),
        add_bos=_opt_bool(scalar(r, "tokenizer.ggml.add_bos_token")),
        add_eos=_opt_bool(scalar(r, "tokenizer.ggml.add_eos_token")),
    )


def _stat_key(path: Path) -> tuple[str, int, int]:
    try:
        st = path.stat()
    except OSError as e:
        raise ModelLoadError(f"model file not found: {path}", param="model") from e
    return str(path.resolve()), st.st_size, st.st_mtime_ns


_cache: dict[tuple[str, int, int], TokenizerFields | None] = {}
_cache_lock = threading.Lock()


def read_tokenizer_fields(path: str | os.PathLike[str]) -> TokenizerFields | None:
    """The tokenizer of a GGUF file (None: it has none); cached per (path, size, mtime).
    ModelLoadError if the file is missing or unreadable."""
    p = Path(path)
    key = _stat_key(p)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    fields = _tokenizer_fields(p)
    with _cache_lock:
        _cache[key] = fields
    return fields


def read_token_texts(path: str | os.PathLike[str]) -> list[bytes]:
    """Every token's text, by id (not cached: only needed when two tokenizers differ)."""
    blob = array_bytes(open_header(Path(path)), "tokenizer.ggml.tokens") or b""
    out: list[bytes] = []
    offs, end = 0, len(blob)
    while offs < end:
        (n,) = struct.unpack_from("<Q", blob, offs)
        out.append(blob[offs + 8 : offs + 8 + n])
        offs += 8 + n
    return out
