"""What a store model's manifest says beyond its GGUF: the layers Ollama writes, read as Ollama
reads them (server/images.go GetModel), and judged for what memspec can honour.

    entry = read_store_model(store, parse("llama3.2:1b"))
    if isinstance(entry, str): ...          # a bad model: why (unreadable manifest, no blob)
    entry.model_path, entry.options, entry.system, entry.license, entry.messages
    entry.refused                           # a layer memspec cannot honour, named; else None

Layers, by media type (application/vnd.ollama.image.*):
- `model`: the GGUF, served in place (the last one, as Ollama takes the last);
- `params`: default options (a JSON object; a request's own options win);
- `system`: the default system prompt; `license`: shown by /api/show (each one);
- `messages`: a conversation put before every chat's own (Ollama's MESSAGE), when it is plain
  role/content turns; anything else in it refuses the model;
- `template` (and its old name `prompt`): a Go template, never executed here: the GGUF's own
  chat template renders chats, and /api/show says so;
- `embed` (deprecated, Ollama ignores it too) and `draft` (memspec builds its own drafts) are
  not used, and noted;
- `projector` (vision), `adapter` (LoRA), `tensor` and `json` (a safetensors model), and any
  type not named here refuse the model, naming the layer: the model is listed, never run
  without what its author put in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memspec.errors import InvalidRequest
from memspec.ollama_name import OllamaName
from memspec.ollama_store import (
    MEDIA_ADAPTER,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    Manifest,
    OllamaStore,
)

_PREFIX = "application/vnd.ollama.image."
MEDIA_PROMPT = _PREFIX + "prompt"  # the template's name before Ollama 0.1.x
MEDIA_EMBED = _PREFIX + "embed"
MEDIA_DRAFT = _PREFIX + "draft"
MAX_TEXT_LAYER = 1 << 20  # bytes: a params, system, template, license or messages layer

# Layers refused, with what they are (the error names both).
REFUSED_LAYERS = {
    MEDIA_PROJECTOR: "a vision projector; memspec serves text models only",
    MEDIA_ADAPTER: "a LoRA adapter; memspec does not apply adapters",
    _PREFIX + "tensor": "a safetensors tensor; memspec serves GGUF models only",
    _PREFIX + "json": "a safetensors model's config; memspec serves GGUF models only",
}
_MESSAGE_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, eq=False)
class StoreModel:
    name: OllamaName
    store: OllamaStore
    manifest: Manifest
    manifest_path: Path
    modified: float  # the manifest file's mtime (Ollama's modified_at)
    model_path: Path  # the GGUF blob, used in place
    options: dict[str, Any]  # .params: default options, as Ollama's JSON names them
    system: str | None
    license: tuple[str, ...]
    template: str | None  # the Go template's text: shown, never executed
    messages: tuple[dict[str, str], ...]
    refused: str | None  # why it is listed but not served; None: served
    notes: tuple[str, ...]  # layers present and not used (shown by /api/show)

    @property
    def digest(self) -> str:
        """Ollama's digest of the model: the manifest's SHA-256."""
        return self.manifest.digest

    @property
    def adopted(self) -> bool:
        """From the user's Ollama store (read-only), not memspec's own."""
        return not self.store.writable


def layer_kind(media_type: str) -> str:
    """`.params` for application/vnd.ollama.image.params (how errors name a layer)."""
    return "." + media_type.removeprefix(_PREFIX) if media_type.startswith(_PREFIX) else media_type


def read_store_model(store: OllamaStore, name: OllamaName) -> StoreModel | str:
    """The model `name` in `store`, its layers read; a string saying why when it is a bad
    model (the manifest unreadable, a layer's blob missing or malformed, no GGUF layer)."""
    path = store.manifest_path(name)
    try:
        modified = path.stat().st_mtime
        manifest = store.read_manifest(name)
    except InvalidRequest as e:
        return f"its manifest cannot be read: {e.message}"
    except OSError as e:
        return f"its manifest cannot be read ({type(e).__name__})"
    if manifest is None:
        return "its manifest is gone"
    model_path: Path | None = None
    options: dict[str, Any] = {}
    system: str | None = None
    licenses: list[str] = []
    template: str | None = None
    messages: tuple[dict[str, str], ...] = ()
    refused: list[str] = []
    notes: list[str] = []
    for layer in manifest.layers:
        kind = layer_kind(layer.media_type)
        blob = store.blob_path(layer.digest)
        if not blob.is_file():
            return f"the blob {layer.digest} of its {kind} layer is missing from the store"
        mt = layer.media_type
        if mt == MEDIA_MODEL:
            size = blob.stat().st_size
            if size != layer.size:
                return (
                    f"its model blob {layer.digest} is {size} bytes, the manifest says "
                    f"{layer.size} (an interrupted copy?)"
                )
            model_path = blob
            continue
        if mt in REFUSED_LAYERS:
            refused.append(f"its {kind} layer is {REFUSED_LAYERS[mt]}")
            continue
        if mt == MEDIA_EMBED:
            notes.append(f"{kind} layer ignored (deprecated; Ollama ignores it too)")
            continue
        if mt == MEDIA_DRAFT:
            notes.append(f"{kind} layer not used: memspec builds and chooses its own drafts")
            continue
        if mt not in (MEDIA_PARAMS, MEDIA_SYSTEM, MEDIA_LICENSE, MEDIA_TEMPLATE, MEDIA_PROMPT,
                      MEDIA_MESSAGES):  # fmt: skip
            refused.append(f"its {kind} layer ({mt}) is of a type memspec does not know")
            continue
        text = _read_text(blob, layer.size)
        if text is None:
            return f"its {kind} layer's blob is not UTF-8 text of at most {MAX_TEXT_LAYER} bytes"
        if mt == MEDIA_PARAMS:
            try:
                doc = json.loads(text)
            except ValueError:
                return f"its {kind} layer is not JSON"
            if not isinstance(doc, dict):
                return f"its {kind} layer is not a JSON object"
            options.update(doc)
        elif mt == MEDIA_SYSTEM:
            system = text
        elif mt == MEDIA_LICENSE:
            licenses.append(text)
        elif mt in (MEDIA_TEMPLATE, MEDIA_PROMPT):
            template = text
            notes.append(
                f"{kind} layer (a Go template) not executed: chats use the GGUF's own chat template"
            )
        else:  # messages
            try:
                doc = json.loads(text)
            except ValueError:
                return f"its {kind} layer is not JSON"
            turns = _plain_turns(doc)
            if turns is None:
                refused.append(
                    f"its {kind} layer holds more than role/content turns (images, tool calls "
                    "or another role), which memspec does not put before a chat"
                )
            else:
                messages = turns
    if model_path is None:
        return "its manifest has no model (GGUF) layer"
    return StoreModel(
        name=name,
        store=store,
        manifest=manifest,
        manifest_path=path,
        modified=modified,
        model_path=model_path,
        options=options,
        system=system,
        license=tuple(licenses),
        template=template,
        messages=messages,
        refused="; ".join(refused) or None,
        notes=tuple(notes),
    )


def _read_text(blob: Path, size: int) -> str | None:
    if size > MAX_TEXT_LAYER:
        return None
    try:
        with open(blob, "rb") as f:
            raw = f.read(MAX_TEXT_LAYER + 1)
        if len(raw) > MAX_TEXT_LAYER:
            return None
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _plain_turns(doc: Any) -> tuple[dict[str, str], ...] | None:
    """Ollama's messages layer as role/content turns; None when it holds anything else."""
    if not isinstance(doc, list):
        return None
    turns = []
    for m in doc:
        if not isinstance(m, dict) or m.get("role") not in _MESSAGE_ROLES:
            return None
        content = m.get("content", "")
        extra = {k: v for k, v in m.items() if k not in ("role", "content") and v}
        if not isinstance(content, str) or extra:
            return None
        turns.append({"role": m["role"], "content": content})
    return tuple(turns)
