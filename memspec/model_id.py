"""The name the daemon serves its target as (/v1/models, /api/tags, /health, every answer).

    served_model_id(settings.model_name, target_path)

The operator's `model_name` when set; else the name Ollama's library gives the same model
(`qwen2.5-coder:1.5b`, `smollm2:135m`, `gemma3:270m`), which is what a Jetson user types; else
the file stem made into an id. `model_aliases` lists what else a request may call it: the file
name and stem, the old id from the GGUF's `general.name`, and `NAME:latest` for an untagged name.
"""

from __future__ import annotations

import re
from pathlib import Path

_NOT_ID = re.compile(r"[^a-z0-9._-]+")

# File stem (lowercase) prefix -> Ollama library name. Quantization and fine-tune suffixes
# after the prefix (-instruct-q4_k_m, -f32) name the same model.
OLLAMA_NAMES: tuple[tuple[str, str], ...] = (
    ("qwen2.5-coder-1.5b", "qwen2.5-coder:1.5b"),
    ("qwen2.5-coder-0.5b", "qwen2.5-coder:0.5b"),
    ("gemma-3-270m", "gemma3:270m"),
    ("smollm2-135m", "smollm2:135m"),
)


def as_model_id(text: str) -> str:
    """Lowercase; each run of characters outside [a-z0-9._-] becomes one '-'; no '-' at the ends."""
    return _NOT_ID.sub("-", text.lower()).strip("-")


def ollama_name(path: str | Path) -> str | None:
    """Ollama's library name for the model in this file, if it is one of the known families."""
    stem = Path(path).stem.lower()
    return next((name for prefix, name in OLLAMA_NAMES if stem.startswith(prefix)), None)


def served_model_id(model_name: str | None, path: str | Path) -> str:
    if model_name:
        return model_name
    return ollama_name(path) or as_model_id(Path(path).stem) or Path(path).stem or "model"


def model_aliases(served: str, general_name: str | None, path: str | Path) -> frozenset[str]:
    """Every name a request may use for the served model (the served name included)."""
    p = Path(path)
    names = {served, p.name, p.stem, as_model_id(p.stem)}
    if general_name and (old := as_model_id(general_name)):
        names.add(old)  # the id served before the Ollama names (wave 3 clients keep working)
    names |= {f"{n}:latest" for n in list(names) if ":" not in n}
    return frozenset(n for n in names if n)


def gguf_general_name(path: str | Path) -> str | None:
    """`general.name` from a GGUF header; None if the file has none or cannot be read."""
    from memspec.drafts.gguf_header import open_header, scalar
    from memspec.errors import ModelLoadError

    try:
        name = scalar(open_header(Path(path)), "general.name")
    except ModelLoadError:
        return None
    return name if isinstance(name, str) else None
