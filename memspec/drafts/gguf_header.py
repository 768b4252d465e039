"""A GGUF file's header, read with the `gguf` package without loading the model.

GGUFReader turns every element of every array field into its own numpy view, which for a
tokenizer (49k tokens and 49k merges, or Gemma's 262k tokens) takes seconds; `HeaderReader`
keeps an array field as its raw bytes instead and parses everything else as GGUFReader does.

It lives here, below both users, because memspec.memory (model shapes) imports memspec.drafts,
and the drafts need the tokenizer fields (memspec.drafts.compat) without importing memory.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
)

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


# --- a bounded check before any parse -------------------------------------------------------
# GGUFReader allocates per declared tensor and array element before it reads one: a 28-byte
# header declaring 2^40 tensors, the rest of a sparse file zeros, kept the daemon from ever
# getting ready. llama.cpp's own parser refuses such counts against the file size; this does
# the same, in one pass over the header with every length checked before it is used. Its cost
# is bounded by the caps below (whatever the file claims), not by the file.
MAX_TENSORS = 1 << 16  # the largest models have a few thousand
MAX_KV = 1 << 16
MAX_ARRAY = 1 << 22  # elements of one array (tokenizers: up to ~262k tokens)
MAX_STRING = 1 << 24  # bytes of one string (chat templates are tens of KiB)
MAX_NAME = 64  # GGML_MAX_NAME
MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_KV = 8 + 1 + 4 + 1  # key length, a 1-byte key, the type, a 1-byte value
_MIN_TENSOR = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, one dim, type, offset


class _Bad(Exception):
    pass


class _Cursor:
    """Reads little-endian fields from a mapped file, each one checked against its size (the
    map costs address space only: just the pages read are touched)."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Bad(f"{what} ({n} bytes at offset {self.pos}) runs past the end of the file")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def u32(self, what: str) -> int:
        self.need(4, what)
        self.pos += 4
        return _U32.unpack_from(self.buf, self.pos - 4)[0]

    def u64(self, what: str) -> int:
        self.need(8, what)
        self.pos += 8
        return _U64.unpack_from(self.buf, self.pos - 8)[0]

    def string(self, what: str, limit: int = MAX_STRING) -> bytes:
        n = self.u64(what)
        if n > limit:
            raise _Bad(f"{what} declares {n} bytes (at most {limit})")
        return self.take(n, what)

    def strings(self, n: int, what: str) -> None:
        """Skip n strings (the hot loop of a tokenizer's 49k-262k tokens: kept tight)."""
        buf, pos, end = self.buf, self.pos, self.size
        for i in range(n):
            if pos + 8 > end:
                raise _Bad(f"{what}[{i}] runs past the end of the file")
            length = _U64.unpack_from(buf, pos)[0]
            pos += 8 + length
            if length > MAX_STRING or pos > end:
                raise _Bad(f"{what}[{i}] declares {length} bytes past the end of the file")
        self.pos = pos


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def _skip_value(c: _Cursor, vtype: int, key: str) -> int | None:
    """Skip one value of `vtype`; a scalar integer's value is returned (general.alignment)."""
    try:
        t = GGUFValueType(vtype)
    except ValueError:
        raise _Bad(f"key {key!r}: unknown value type {vtype}") from None
    if t in _SCALAR_SIZE:
        raw = c.take(_SCALAR_SIZE[t], f"value of {key!r}")
        return int.from_bytes(raw, "little") if t == GGUFValueType.UINT32 else None
    if t == GGUFValueType.STRING:
        c.string(f"value of {key!r}")
        return None
    # An array: item type, count, items; nested arrays are refused (llama.cpp's too).
    itype, n = c.u32(f"{key!r} item type"), c.u64(f"{key!r} length")
    if n > MAX_ARRAY:
        raise _Bad(f"array {key!r} declares {n} elements (at most {MAX_ARRAY})")
    try:
        it = GGUFValueType(itype)
    except ValueError:
        raise _Bad(f"array {key!r}: unknown item type {itype}") from None
    if it in _SCALAR_SIZE:
        c.skip(n * _SCALAR_SIZE[it], f"array {key!r}")
    elif it == GGUFValueType.STRING:
        c.need(n * 8, f"array {key!r}")  # each string has at least its length
        c.strings(n, key)
    else:
        raise _Bad(f"array {key!r}: nested arrays are not supported")
    return None


def check_gguf(path: Path) -> None:
    """ModelLoadError unless `path`'s header is one every later reader can parse within the
    file: counts, lengths and tensor extents checked against its size, nothing allocated by
    what it claims. Cached by file identity (path, size, mtime)."""
    key = _stat_key(path)
    with _cache_lock:
        if key in _checked:
            if _checked[key] is not None:
                raise ModelLoadError(_checked[key], param="model")
            return
    try:
        with open(path, "rb") as f:
            if key[1] == 0:
                raise _Bad("empty file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _check_header(_Cursor(buf, key[1]))
        problem = None
    except _Bad as e:
        problem = f"{path.name} is not a valid GGUF file: {e}"
    except OSError as e:
        raise ModelLoadError(f"cannot read {path.name}: {e.strerror or e}", param="model") from e
    with _cache_lock:
        _checked[key] = problem
    if problem is not None:
        raise ModelLoadError(problem, param="model")


def _check_header(c: _Cursor) -> None:
    if c.take(4, "magic") != b"GGUF":
        raise _Bad("no GGUF magic")
    version = c.u32("version")
    if version not in (2, 3):
        raise _Bad(f"GGUF version {version} (2 or 3 supported)")
    n_tensors, n_kv = c.u64("tensor count"), c.u64("key count")
    if n_tensors > MAX_TENSORS or n_tensors * _MIN_TENSOR > c.size:
        raise _Bad(f"declares {n_tensors} tensors: more than a file of {c.size} bytes can hold")
    if n_kv > MAX_KV or n_kv * _MIN_KV > c.size:
        raise _Bad(f"declares {n_kv} keys: more than a file of {c.size} bytes can hold")
    alignment = GGUF_DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for i in range(n_kv):
        key = c.string(f"key {i}", limit=1 << 16).decode("utf-8", errors="replace")
        if not key or key in keys:
            raise _Bad(f"key {i}: {'empty' if not key else 'duplicate'} key {key[:80]!r}")
        keys.add(key)
        shown = key[:80]  # a message names at most 80 characters of a key, never the whole file
        value = _skip_value(c, c.u32(f"type of {shown!r}"), shown)
        if key == "general.alignment":
            if value is None or value <= 0 or value & (value - 1):
                raise _Bad(f"general.alignment {value} is not a power of two")
            alignment = value
    names: set[bytes] = set()
    extents: list[tuple[bytes, int, int]] = []
    for i in range(n_tensors):
        name = c.string(f"tensor {i} name", limit=MAX_NAME)
        if not name or name in names:
            raise _Bad(f"tensor {i}: {'empty' if not name else 'duplicate'} name {name!r}")
        names.add(name)
        n_dims = c.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Bad(f"tensor {name!r}: {n_dims} dimensions (1 to {MAX_DIMS})")
        n = 1
        for d in range(n_dims):
            dim = c.u64(f"tensor {name!r} dim {d}")
            if dim == 0 or dim > c.size * 8:  # no element is smaller than a bit
                raise _Bad(f"tensor {name!r}: dimension {dim}")
            n *= dim
        ttype = c.u32(f"tensor {name!r} type")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise _Bad(f"tensor {name!r}: unknown type {ttype}") from None
        offset = c.u64(f"tensor {name!r} offset")
        if n % block or offset % alignment:
            raise _Bad(f"tensor {name!r}: not a whole number of blocks, or misaligned")
        extents.append((name, offset, n // block * type_size))
    data_start = -(-c.pos // alignment) * alignment
    for name, offset, nbytes in extents:
        if data_start + offset + nbytes > c.size:
            raise _Bad(
                f"tensor {name.decode(errors='replace')!r} ({nbytes} bytes at {offset}) runs "
                "past the end of the file"
            )


_checked: dict[tuple[str, int, int], str | None] = {}  # file identity -> problem (None: ok)


def open_header(path: Path) -> HeaderReader:
    """The header of a GGUF file; ModelLoadError if it is missing, unreadable, or declares
    more than the file holds (check_gguf, before anything is allocated)."""
    check_gguf(path)
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
