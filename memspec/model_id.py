"""The id the daemon serves its target as (/v1/models, /health, responses, status).

    served_model_id(settings.model_name, metadata.get("general.name"), target_path)

The operator's `model_name` when set; else the GGUF's `general.name` made into an id; else the
file stem made into one. The runtime calls it with the metadata its backend already read;
`gguf_general_name` reads it from the header, for tools that have no model loaded (the tests:
what will a daemon on this file call itself?).
"""

from __future__ import annotations

import re
from pathlib import Path

_NOT_ID = re.compile(r"[^a-z0-9._-]+")


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
    """`general.name` from a GGUF header; None if the file has none or cannot be read."""
    from memspec.drafts.gguf_header import open_header, scalar
    from memspec.errors import ModelLoadError

    try:
        name = scalar(open_header(Path(path)), "general.name")
    except ModelLoadError:
        return None
    return name if isinstance(name, str) else None
