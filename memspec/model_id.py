"""The id the daemon serves its target as (/v1/models, /health, responses, status).

    served_model_id(settings.model_name, metadata.get("general.name"), target_path)

The operator's `model_name` when set; else the GGUF's `general.name` made into an id; else the
file stem made into one. The runtime calls it with the metadata its backend already read;
`gguf_general_name` reads only the header's first keys, for tools that have no model loaded
(the tests: what will a daemon on this file call itself?).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import BinaryIO

_NOT_ID = re.compile(r"[^a-z0-9._-]+")

# GGUF value types (gguf spec): fixed sizes of the scalars; 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def as_model_id(text: str) -> str:
    """Lowercase; each run of characters outside [a-z0-9._-] becomes one '-'; no '-' at the ends."""
    return _NOT_ID.sub("-", text.lower()).strip("-")


def served_model_id(model_name: str | None, general_name: str | None, path: str | Path) -> str:
    if model_name:
        return model_name
    for text in (general_name, Path(path).stem):
        if text and (model_id := as_model_id(text)):
            return model_id
    return Path(path).stem or "model"


def gguf_general_name(path: str | Path) -> str | None:
    """`general.name` from a GGUF header; None if the file has none or cannot be read.

    general.* keys come first in files llama.cpp's converters write, so the scan stops after a
    few keys instead of walking the tokenizer's arrays."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            _version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            for _ in range(n_kv):
                key = _read_str(f)
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.name":
                    return _read_str(f) if kind == _GGUF_STRING else None
                _skip(f, kind)
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None
    return None


def _read_str(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8")


def _skip(f: BinaryIO, kind: int) -> None:
    if kind == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == _GGUF_ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    elif kind in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[kind], 1)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
