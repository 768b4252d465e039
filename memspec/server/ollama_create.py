"""Ollama's POST /api/create, HEAD and POST /api/blobs/{digest}, POST /api/copy: models made
from a GGUF and a Modelfile's settings, written into memspec's own store (memspec.ollama_store)
in Ollama's layout, where the catalog serves them at once.

Wire behaviour follows Ollama's server (routes.go CreateHandler, CreateBlobHandler,
HeadBlobHandler, CopyHandler; create.go):
- /api/blobs/{digest}: HEAD 200 when the blob is in the own store or the adopted one, else 404;
  POST streams the body into the own store (never whole in memory) and answers 201, or 200
  when the blob is already there; a body whose SHA-256 is not the digest is a 400 ("digest
  mismatch") and nothing of it stays, nor of an upload cut short. A body larger than the disk
  has free (less a reserve) is a 413 before or while it is read.
- /api/create takes Ollama >= 0.5's JSON (`from`, `files` {name: digest}, `parameters`,
  `system`, `license`, `messages`, `quantize`, ...) and older clients' `modelfile` text
  (memspec.modelfile). FROM is a model in either store, a GGUF the catalog serves, an
  uploaded blob (`files`), or a GGUF path inside the models dir (nothing outside it is read).
  Every check runs before the first progress line, so a bad request is a 400 (404 for an
  unknown FROM) with {"error"}; then NDJSON progress as Ollama's (`parsing GGUF`, `quantizing
  F32 model to Q4_K_M` with total/completed, `creating new layer sha256:...`, `writing
  manifest`, `success`). TEMPLATE and ADAPTER (and a FROM with a projector or an adapter)
  are refused naming them: this daemon renders chats with the GGUF's own template and serves
  no LoRA or vision projector. `quantize` runs llama.cpp's quantizer (memspec.quantize) into
  a temp file that becomes a blob once whole; only F32/F16/BF16 models are quantized.
- /api/copy writes the source's manifest under the new name (the same digest).
- Names are checked as Ollama checks them (memspec.ollama_name): `..`, a path, 5,000
  characters are a 400 before any file is touched.
- A valid name compares ignoring case, as Ollama's (getExistingName): a FROM or a copy's
  source finds `SmolLM2:Q8` as the stored `smollm2:q8`; a create's name or a copy's
  destination that differs from a model's only by case replaces that model under its own
  spelling (no second manifest beside it).
Nothing is written into an adopted Ollama store: a blob of it that a new model needs is hard
linked into the own store (same filesystem) or copied, and the log says which. A create runs
to its end even when its client leaves, so no model is left half-written; creates and copies
take turns (one lock), which keeps one from pruning a blob another is about to use.
All of it changes files on disk: the admin key (as /api/pull), and the Host/Origin guard.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from memspec import modelfile, ollama_name
from memspec import quantize as quantizer
from memspec.drafts.family import FTYPE_NAMES
from memspec.errors import InvalidRequest, MemSpecError, ModelLoadError, UnknownModel
from memspec.files import recorded_sha256
from memspec.ollama_name import OllamaName
from memspec.ollama_store import (
    CONFIG_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    MEDIA_ADAPTER,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_SYSTEM,
    BlobMismatch,
    Layer,
    Manifest,
    OllamaStore,
    adopted_store,
    check_digest,
    own_store,
)
from memspec.paths import models_dir
from memspec.server.auth import require_admin_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.errors import PayloadTooLarge
from memspec.server.ollama_api import HARDWARE_OPTIONS, OPTION_FIELDS
from memspec.server.ollama_pull import read_body, require_json

log = logging.getLogger("memspec.server")

router = APIRouter(
    tags=["ollama"], dependencies=[Depends(require_admin_key), Depends(require_json)]
)
# A blob's body is the file itself (application/octet-stream), not JSON.
blob_router = APIRouter(tags=["ollama"], dependencies=[Depends(require_admin_key)])
# Paths whose bodies the route streams and bounds itself (the BodyLimit middleware lets them by).
STREAMED_PATHS = ("/api/blobs/",)

DISK_RESERVE = 256 << 20  # bytes an upload leaves free on the store's disk
WRITE_CHUNK = 1 << 20  # bytes gathered before one write to disk
COPY_CHUNK = 1 << 20
QUANT_DIGEST = "0" * 19  # the digest Ollama's quantize progress lines carry
_MESSAGE_ROLES = ("system", "user", "assistant")
# Options with a number value, and those with an integer one (/api/chat's options).
_FLOAT_OPTIONS = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                  "frequency_penalty"}  # fmt: skip
_INT_OPTIONS = {"top_k", "seed", "num_predict", "repeat_last_n", "num_ctx"}

# One create or copy at a time: a create that links a blob must not see it pruned by another's
# replaced manifest before its own manifest refers to it.
_store_lock = threading.Lock()


# --- bodies --------------------------------------------------------------------------------


class CreateBody(BaseModel):
    # Go's JSON binding ignores fields it does not know; so do we.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    name: str | None = None  # the older field name
    stream: bool | None = True  # null: the default (Go's *bool)
    quantize: str | None = None
    quantization: str | None = None  # the older field name
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    modelfile: str | None = Field(None, max_length=modelfile.MAX_MODELFILE)  # older clients
    # Newer Ollama's fields that would change what the model does: refused when set.
    draft_files: dict[str, str] | None = None
    draft_quantize: str | None = None
    remote_host: str | None = None
    renderer: str | None = None
    parser: str | None = None
    requires: str | None = None
    draft: str | None = None  # a Modelfile's DRAFT, through `modelfile`


class CopyBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    source: str = ""
    destination: str = ""


# --- checks --------------------------------------------------------------------------------


def check_parameters(params: dict[str, Any] | None) -> dict[str, Any]:
    """A model's default options, checked as /api/chat checks a request's: a null one is
    not set; a hardware hint is kept (the daemon's settings decide, as for a request); an
    option this daemon does not honour is a 400 naming it, as it would be on every chat."""
    out: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if value is None:
            continue
        where = f"parameters.{key}"
        if key in HARDWARE_OPTIONS:
            out[key] = value
            continue
        if key not in OPTION_FIELDS and key != "num_ctx":
            raise InvalidRequest(
                f"{where} is not supported by this server (docs/ollama.md lists the options "
                "it honours)",
                param=where,
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise InvalidRequest(f"{where} must be a string or a list of strings", param=where)
            value = stops
        elif key in _INT_OPTIONS and not (number and float(value).is_integer()):
            raise InvalidRequest(f"{where} must be an integer (got {value!r:.40})", param=where)
        elif key in _FLOAT_OPTIONS and not (number and value == value):
            raise InvalidRequest(f"{where} must be a number (got {value!r:.40})", param=where)
        if key in _INT_OPTIONS:
            value = int(value)
        if key == "num_ctx" and value <= 0:
            raise InvalidRequest(f"{where} must be positive", param=where)
        out[key] = value
    return out


def check_messages(messages: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(messages or []):
        role, content = m.get("role"), m.get("content", "")
        if m.get("images") or m.get("tool_calls"):
            raise InvalidRequest(
                f"messages[{i}]: images and tool calls in a model's messages are not supported",
                param=f"messages[{i}]",
            )
        if role not in _MESSAGE_ROLES or not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}]: the role must be one of system, user, assistant and the "
                "content a string",
                param=f"messages[{i}]",
            )
        out.append({"role": role, "content": content})
    return out


def _valid_file_name(name: str) -> bool:
    """Go's fs.ValidPath: slash-separated, unrooted, no empty, '.' or '..' element."""
    if name == ".":
        return True
    return (
        bool(name)
        and not name.startswith("/")
        and all(part not in ("", ".", "..") for part in name.split("/"))
    )


# --- sources -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a model's weights come from: a blob of the own or adopted store, or a file."""

    path: Path
    store: OllamaStore | None = None  # None: a loose file in the models dir
    digest: str | None = None  # known for a blob; hashed later for a file

    @property
    def where(self) -> str:
        if self.store is None:
            return str(self.path)
        return f"{'own' if self.store.writable else 'adopted'} store {self.digest}"


@dataclass
class Plan:
    """A create, checked: everything it will write is decided before the first line goes out."""

    name: OllamaName
    model: Source
    carried: list[tuple[Layer, OllamaStore]] = field(default_factory=list)  # base layers kept
    base_params: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    licenses: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    quantize: str | None = None  # Ollama's type name, upper-cased; None: keep the file's type
    file_type: int | None = None  # the source's llama_ftype


def _stores(ctx: ServerContext) -> list[OllamaStore]:
    stores = [own_store()]
    adopted = adopted_store(ctx.settings)
    if adopted is not None:
        stores.append(adopted)
    return stores


def _find_manifest(ctx: ServerContext, name: OllamaName) -> tuple[Manifest, OllamaStore] | None:
    for store in _stores(ctx):
        manifest = store.read_manifest(store.existing_name(name))  # ignoring case, as Ollama
        if manifest is not None:
            return manifest, store
    return None


def _blob_source(ctx: ServerContext, digest: str) -> Source | None:
    for store in _stores(ctx):
        if store.has_blob(digest):
            return Source(store.blob_path(digest), store, digest)
    return None


def _in_models_dir(path: Path) -> Path | None:
    root = models_dir().resolve()
    try:
        real = path.resolve()
    except (OSError, RuntimeError):
        return None
    return real if real.is_relative_to(root) and real.is_file() else None


def _from_name(ctx: ServerContext, plan_name: OllamaName, asked: str) -> tuple[Source, Plan]:
    """A FROM: a model in a store, a GGUF the catalog serves, or a GGUF path in the models
    dir. UnknownModel when none answers; InvalidRequest for a path outside the models dir."""
    parsed: OllamaName | None = None
    try:
        parsed = ollama_name.parse(asked, param="from")
    except InvalidRequest:
        if not modelfile.looks_like_path(asked):
            raise
    if parsed is not None:
        found = _find_manifest(ctx, parsed)
        if found is not None:
            return _from_manifest(plan_name, asked, *found)
        served = ctx.worker.catalog.find(parsed.local) or ctx.worker.catalog.find(asked)
        if served is not None and (real := _in_models_dir(served.path)) is not None:
            return Source(real), Plan(plan_name, Source(real))
    if modelfile.looks_like_path(asked):
        given = Path(asked).expanduser()
        path = given if given.is_absolute() else models_dir() / given
        real = _in_models_dir(path)
        if real is None:
            raise InvalidRequest(
                f"FROM {asked[:200]!r}: not a GGUF file inside the models directory "
                f"({models_dir()}); upload a file elsewhere as a blob (the ollama client does "
                "so for a FROM path) or put it there",
                param="from",
            )
        return Source(real), Plan(plan_name, Source(real))
    raise UnknownModel(f"model '{asked[:200]}' not found", param="from")


def _from_manifest(
    plan_name: OllamaName, asked: str, manifest: Manifest, store: OllamaStore
) -> tuple[Source, Plan]:
    model_layer: Layer | None = None
    carried: list[tuple[Layer, OllamaStore]] = []
    for layer in manifest.layers:
        if layer.media_type in (MEDIA_PROJECTOR, MEDIA_ADAPTER):
            kind = "a vision projector" if layer.media_type == MEDIA_PROJECTOR else "an adapter"
            raise InvalidRequest(
                f"FROM {asked[:200]}: the model has {kind} layer ({layer.media_type}), which "
                "this server does not serve",
                param="from",
            )
        if layer.media_type == MEDIA_MODEL and model_layer is None:
            model_layer = layer
        else:
            carried.append((layer, store))
    if model_layer is None:
        raise InvalidRequest(f"FROM {asked[:200]}: the model has no GGUF layer", param="from")
    source = Source(store.blob_path(model_layer.digest), store, model_layer.digest)
    return source, Plan(plan_name, source, carried)


def _from_files(ctx: ServerContext, files: dict[str, str]) -> Source:
    for name, digest in files.items():
        if not _valid_file_name(name):
            raise InvalidRequest("file path must be relative", param="files")  # Ollama's words
        check_digest(digest)
    if len(files) != 1:
        raise InvalidRequest(
            f"memspec creates a model from one GGUF file; got {len(files)} files "
            "(safetensors and split GGUFs are not converted here)",
            param="files",
        )
    digest = check_digest(next(iter(files.values())))
    source = _blob_source(ctx, digest)
    if source is None:
        raise InvalidRequest(
            f"blob {digest} not found: upload it first (POST /api/blobs/{digest})",
            param="files",
        )
    return source


def _check_gguf(source: Source, asked: str) -> int | None:
    """The source's llama_ftype; a 400 unless it is a GGUF model this server can use."""
    try:
        with open(source.path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InvalidRequest(
            f"{asked}: its GGUF ({source.where}) cannot be read: {e.strerror or e}", param="from"
        ) from None
    if magic != b"GGUF":
        raise InvalidRequest("supplied file was not in GGUF format", param="files")
    from memspec.drafts.gguf_header import open_header, scalar

    try:
        header = open_header(source.path)
    except ModelLoadError as e:
        raise InvalidRequest(f"{asked}: {e.message}", param="files") from None
    kind = scalar(header, "general.type")
    if kind == "adapter":
        raise InvalidRequest(
            "ADAPTER is not supported: this server serves no LoRA adapters", param="adapters"
        )
    if scalar(header, "general.architecture") == "clip":
        raise InvalidRequest(
            "the file is a vision projector, which this server does not serve", param="files"
        )
    value = scalar(header, "general.file_type")
    return int(value) if isinstance(value, int) else None


def make_plan(ctx: ServerContext, body: CreateBody) -> Plan:
    """Every check of a create, in Ollama's order where it has one; raises the 400 or 404."""
    asked = body.model or body.name
    if not asked or not asked.strip():
        raise InvalidRequest("model is required", param="model")
    # A name that differs from a model's only by case is that model (Ollama's getExistingName):
    # the create replaces it, under its spelling, rather than writing a second manifest.
    name = own_store().existing_name(ollama_name.parse(asked))
    if body.modelfile:
        _merge_modelfile(body)
    refused = {
        "template": ("TEMPLATE", "this server renders chats with the GGUF's own chat template"),
        "adapters": ("ADAPTER", "this server serves no LoRA adapters"),
        "draft_files": ("DRAFT", "drafts are built by this server (docs/drafts.md)"),
        "draft": ("DRAFT", "drafts are built by this server (docs/drafts.md)"),
        "draft_quantize": ("draft_quantize", "drafts are built by this server"),
        "remote_host": ("remote_host", "this server serves local models only"),
        "renderer": ("RENDERER", "this server renders chats with the GGUF's own chat template"),
        "parser": ("PARSER", "this server parses no model-specific output"),
    }
    for field_name, (what, why) in refused.items():
        if getattr(body, field_name):
            raise InvalidRequest(f"{what} is not supported: {why}", param=field_name)
    params = check_parameters(body.parameters)
    messages = check_messages(body.messages)
    quant = body.quantize or body.quantization
    quant_name = quantizer.quant_type(quant)[0] if quant else None
    if body.from_:
        source, plan = _from_name(ctx, name, body.from_)
    elif body.files:
        source = _from_files(ctx, body.files)
        plan = Plan(name, source)
    else:
        raise InvalidRequest("neither 'from' or 'files' was specified")  # Ollama's words
    plan.file_type = _check_gguf(source, body.from_ or "the uploaded file")
    if quant_name is not None and type_name(plan.file_type) != quant_name:
        if plan.file_type not in quantizer.UNQUANTIZED:
            raise InvalidRequest(
                "quantization is only supported for F16, BF16 and F32 models (this one is "
                f"{type_name(plan.file_type)})",
                param="quantize",
            )
        plan.quantize = quant_name
    plan.params = params
    plan.messages = messages
    plan.system = body.system or None
    lic = body.license
    plan.licenses = [lic] if isinstance(lic, str) and lic else list(lic or [])
    for layer, store in plan.carried:
        if layer.media_type == MEDIA_PARAMS:
            plan.base_params = _read_json(store, layer, "parameters")
    return plan


def _merge_modelfile(body: CreateBody) -> None:
    """An older client's `modelfile` text, as the JSON fields it means (those the JSON sets
    itself win)."""
    mf = modelfile.parse(body.modelfile or "")
    for key, value in modelfile.create_fields(mf).items():
        attr = "from_" if key == "from" else key
        if getattr(body, attr, None) in (None, "", [], {}):
            setattr(body, attr, value)
    for warning in mf.warnings:
        log.info("create %s: %s", body.model or body.name, warning)


def _read_json(store: OllamaStore, layer: Layer, what: str) -> dict[str, Any]:
    if layer.size > 1 << 20:
        raise InvalidRequest(f"the base model's {what} layer is over 1 MiB", param="from")
    try:
        value = json.loads(store.blob_path(layer.digest).read_bytes())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"the base model's {what} layer is unreadable: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"the base model's {what} layer is not a JSON object", param="from")
    return value


# --- the create ----------------------------------------------------------------------------

Emit = Callable[[dict[str, Any]], None]


def _layer_status(store: OllamaStore, digest: str) -> str:
    return ("using existing layer " if store.has_blob(digest) else "creating new layer ") + digest


def put_bytes(store: OllamaStore, data: bytes, media_type: str, emit: Emit) -> Layer:
    """A small layer (system, params, ...) as a blob of `store`."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    emit({"status": _layer_status(store, digest)})
    if not store.has_blob(digest):
        writer = store.open_blob_writer(digest)
        try:
            if writer.offset:  # a stale partial: start over
                writer.abort()
                writer.partial.unlink(missing_ok=True)
                writer = store.open_blob_writer(digest)
            writer.write(data)
            writer.commit()
        finally:
            writer.abort()
    return Layer(media_type, digest, len(data))


def place_file(store: OllamaStore, src: Path, digest: str | None, why: str) -> tuple[str, int]:
    """`src` as a blob of `store` (its digest and size): hard linked when on the same
    filesystem, else copied (checked against the digest as it goes); the log says which."""
    if digest is None:
        digest = "sha256:" + (recorded_sha256(src) or _sha256(src))
    size = src.stat().st_size
    target = store.blob_path(digest)
    if target.is_file():
        return digest, size
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, target)
        log.info("%s: hard linked %s into %s as %s", why, src, store.root, digest)
        return digest, size
    except FileExistsError:
        return digest, size
    except OSError as e:
        log.info("%s: copying %s into %s (no hard link: %s)", why, src, store.root, e.strerror)
    if size > _free_bytes(store):
        raise MemSpecError(f"{why}: {src.name} ({size} bytes) does not fit on the models disk")
    fd, tmp = tempfile.mkstemp(prefix=".copy-", dir=target.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                h.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if "sha256:" + h.hexdigest() != digest:
            raise BlobMismatch(f"{src} does not hash to {digest}: not copied")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.info("%s: copied %s into %s as %s", why, src, store.root, digest)
    return digest, size


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _quantized_layer(
    store: OllamaStore, plan: Plan, n_threads: int, emit: Emit, cancel: threading.Event
) -> Layer:
    src = plan.model.path
    total = src.stat().st_size
    status = f"quantizing {type_name(plan.file_type)} model to {plan.quantize}"
    last = [-1]

    def progress(done: int, tensors: int) -> None:
        completed = total * done // max(tensors, 1)
        if done == tensors or completed - last[0] >= total // 200:  # every 0.5%
            last[0] = completed
            emit({"status": status, "digest": QUANT_DIGEST, "total": total, "completed": completed})

    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".quantize-", suffix=".gguf", dir=store.blobs_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        quantizer.quantize(
            src, tmp, plan.quantize or "", progress, n_threads=n_threads, cancel=cancel
        )
        emit({"status": "verifying conversion"})
        if quantizer.file_type(tmp) != quantizer.QUANT_TYPES[plan.quantize or ""]:
            raise quantizer.QuantizeError(f"the quantizer did not write a {plan.quantize} file")
        digest = "sha256:" + _sha256(tmp)
        emit({"status": _layer_status(store, digest)})
        size = tmp.stat().st_size
        os.chmod(tmp, 0o644)
        os.replace(tmp, store.blob_path(digest))
    finally:
        tmp.unlink(missing_ok=True)
    plan.file_type = quantizer.QUANT_TYPES[plan.quantize or ""]
    return Layer(MEDIA_MODEL, digest, size)


def _config(path: Path, file_type: int | None) -> bytes:
    """The config blob as Ollama's createConfigLayer writes it (model.ConfigV2)."""
    from memspec.drafts.gguf_header import open_header, scalar

    header = open_header(path)
    arch = scalar(header, "general.architecture") or ""
    n_params = sum(int(t.n_elements) for t in header.tensors)
    config = {
        "model_format": "gguf",
        "model_family": arch,
        "model_families": [arch],
        "model_type": human_number(n_params),
        "file_type": type_name(file_type),
        "architecture": "amd64",  # Ollama writes these two as they are, whatever the machine
        "os": "linux",
    }
    return (json.dumps(config, separators=(",", ":")) + "\n").encode()


def type_name(file_type: int | None) -> str:
    """A llama_ftype as Ollama names it (F32, Q4_K_M); "unknown" for none."""
    return FTYPE_NAMES.get(file_type, "unknown") if file_type is not None else "unknown"


def human_number(n: int) -> str:
    """Ollama's format.HumanNumber: 134515008 -> "134.52M", 1.5e9 -> "1.5B"."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value.is_integer() else f"{value:.{digits}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


def manifest_bytes(config: Layer, layers: list[Layer]) -> bytes:
    """A manifest as Ollama's WriteManifest encodes it (compact JSON and a newline)."""

    def entry(x: Layer) -> dict[str, Any]:
        return {"mediaType": x.media_type, "digest": x.digest, "size": x.size}

    doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": entry(config),
        "layers": [entry(x) for x in layers],
    }
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def run_create(plan: Plan, n_threads: int, emit: Emit, cancel: threading.Event) -> Manifest:
    """Write what `plan` decided into the own store; emits Ollama's progress lines."""
    store = own_store()
    why = f"create {plan.name.display}"
    with _store_lock:
        _remove_stale_temps(store)
        old = store.read_manifest(plan.name)
        if plan.quantize:
            model = _quantized_layer(store, plan, n_threads, emit, cancel)
        else:
            if plan.model.store is None:
                emit({"status": "parsing GGUF"})
            digest, size = place_file(store, plan.model.path, plan.model.digest, why)
            emit({"status": f"using existing layer {digest}"})
            model = Layer(MEDIA_MODEL, digest, size)
        layers = [model]
        replaced = {MEDIA_PARAMS} | ({MEDIA_SYSTEM} if plan.system else set())
        if plan.messages:
            replaced.add(MEDIA_MESSAGES)
        for layer, source_store in plan.carried:
            if layer.media_type in replaced:
                continue
            if source_store is not store:
                place_file(store, source_store.blob_path(layer.digest), layer.digest, why)
            emit({"status": f"using existing layer {layer.digest}"})
            layers.append(layer)
        if plan.system:
            layers.append(put_bytes(store, plan.system.encode(), MEDIA_SYSTEM, emit))
        for text in plan.licenses:
            layers.append(put_bytes(store, text.encode(), MEDIA_LICENSE, emit))
        params = {**plan.base_params, **plan.params}
        if params:
            raw = (json.dumps(params, separators=(",", ":")) + "\n").encode()
            layers.append(put_bytes(store, raw, MEDIA_PARAMS, emit))
        if plan.messages:
            raw = (json.dumps(plan.messages, separators=(",", ":")) + "\n").encode()
            layers.append(put_bytes(store, raw, MEDIA_MESSAGES, emit))
        model_path = store.blob_path(model.digest)
        config = put_bytes(store, _config(model_path, plan.file_type), CONFIG_MEDIA_TYPE, emit)
        emit({"status": "writing manifest"})
        manifest = store.write_manifest(plan.name, manifest_bytes(config, layers))
        if old is not None and old.digest != manifest.digest:
            prune(store, old)
    log.info("%s: written (%s, from %s)", why, manifest.digest, plan.model.where)
    return manifest


def _remove_stale_temps(store: OllamaStore) -> None:
    """Temp files a create left when its daemon stopped mid-way (creates take turns, so none
    is in use now)."""
    if store.blobs_dir.is_dir():
        for stale in [*store.blobs_dir.glob(".quantize-*"), *store.blobs_dir.glob(".copy-*")]:
            stale.unlink(missing_ok=True)
            log.info("removed %s, left by an earlier create", stale.name)


def prune(store: OllamaStore, old: Manifest) -> list[Path]:
    """Remove the blobs of a replaced manifest that no manifest of `store` refers to now
    (Ollama's RemoveLayers); the caller holds _store_lock."""
    in_use: set[str] = set()
    for name in store.names():
        try:
            m = store.read_manifest(name)
        except InvalidRequest:
            continue
        if m is not None:
            in_use.update(x.digest for x in (m.config, *m.layers))
    removed = []
    for layer in (old.config, *old.layers):
        blob = store.blob_path(layer.digest)
        if layer.digest not in in_use and blob.is_file():
            blob.unlink()
            removed.append(blob)
            in_use.add(layer.digest)
    return removed


# --- routes --------------------------------------------------------------------------------


def _n_threads(ctx: ServerContext) -> int:
    return int(getattr(ctx.settings, "n_threads", None) or 0)


@router.post("/api/create")
async def create(request: Request, ctx: Ctx) -> Response:
    body: CreateBody = await read_body(request, CreateBody)
    plan = await asyncio.to_thread(make_plan, ctx, body)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    cancel = threading.Event()  # set only at shutdown: a client leaving does not stop it

    def emit(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    def job() -> None:
        try:
            run_create(plan, _n_threads(ctx), emit, cancel)
            if ctx.draft_builds is not None:  # its drafts are built in the background
                ctx.draft_builds.rescan()
            emit({"status": "success"})
        except MemSpecError as e:
            log.warning("create %s failed: %s", plan.name.display, e.message)
            emit({"error": e.message})
        except Exception as e:  # the disk, the quantizer: one line, the log has the rest
            log.warning("create %s failed", plan.name.display, exc_info=True)
            emit({"error": f"create {plan.name.display}: {e}"})
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=job, name=f"create-{plan.name.model}", daemon=True).start()

    async def events() -> AsyncIterator[dict[str, Any]]:
        while (event := await queue.get()) is not None:
            yield event

    if body.stream is False:
        last: dict[str, Any] = {}
        async for event in events():
            if "error" in event:
                return JSONResponse({"error": event["error"]}, status_code=500)
            last = event
        return JSONResponse(last)

    async def lines() -> AsyncIterator[str]:
        async for event in events():
            yield json.dumps(event) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _copy(ctx: ServerContext, source: str, destination: str) -> Manifest:
    src = ollama_name.parse(source, param="source")
    store = own_store()
    # Both names ignore case as Ollama's (getExistingName): a destination that differs from
    # a model's name only by case replaces that model, under its spelling.
    dst = store.existing_name(ollama_name.parse(destination, param="destination"))
    found = _find_manifest(ctx, src)
    why = f"copy {src.display} to {dst.display}"
    if found is None:  # a GGUF the catalog serves: made a model of the own store
        served = ctx.worker.catalog.find(src.local) or ctx.worker.catalog.find(source)
        real = _in_models_dir(served.path) if served is not None else None
        if real is None:
            raise UnknownModel(f'model "{source[:200]}" not found', param="source")
        plan = Plan(dst, Source(real))
        plan.file_type = _check_gguf(plan.model, source)
        return run_create(plan, 0, lambda _event: None, threading.Event())
    manifest, from_store = found
    with _store_lock:
        if from_store is not store:
            for layer in (manifest.config, *manifest.layers):
                place_file(store, from_store.blob_path(layer.digest), layer.digest, why)
        old = store.read_manifest(dst)
        copied = store.write_manifest(dst, manifest.raw)
        if old is not None and old.digest != copied.digest:
            prune(store, old)
    log.info("%s: %s", why, copied.digest)
    return copied


@router.post("/api/copy")
async def copy(request: Request, ctx: Ctx) -> Response:
    body: CopyBody = await read_body(request, CopyBody)
    await asyncio.to_thread(_copy, ctx, body.source, body.destination)
    return Response(status_code=200)  # Ollama answers an empty 200


@blob_router.head("/api/blobs/{digest}")
async def head_blob(digest: str, ctx: Ctx) -> Response:
    digest = check_digest(digest)
    found = await asyncio.to_thread(_blob_source, ctx, digest)
    return Response(status_code=200 if found is not None else 404)


def _free_bytes(store: OllamaStore) -> int:
    path = store.root
    while not path.exists() and path != path.parent:
        path = path.parent
    return max(shutil.disk_usage(path).free - DISK_RESERVE, 0)


@blob_router.post("/api/blobs/{digest}")
async def create_blob(digest: str, request: Request, ctx: Ctx) -> Response:
    digest = check_digest(digest)
    store = own_store()
    if await asyncio.to_thread(store.has_blob, digest):
        return Response(status_code=200)
    room = await asyncio.to_thread(_free_bytes, store)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > room:
        raise PayloadTooLarge(
            f"blob {digest}: {declared} bytes do not fit in the {room} bytes free on the "
            "models disk",
            param="digest",
        )
    # Two uploads of one digest take turns on the store's lock of its partial.
    await _receive_blob(store, digest, request, room)
    return Response(status_code=201)


async def _receive_blob(store: OllamaStore, digest: str, request: Request, room: int) -> None:
    """Stream the body into a fresh partial; checked and renamed on its end, deleted on any
    failure (a mismatch, a body too large, a client that left)."""

    def fresh() -> Any:
        writer = store.open_blob_writer(digest)
        if writer.offset:  # a partial from an earlier upload or a pull: this body is whole
            writer.abort()
            writer.partial.unlink(missing_ok=True)
            writer = store.open_blob_writer(digest)
        return writer

    writer = await asyncio.to_thread(fresh)
    size = 0
    pending: list[bytes] = []
    pending_bytes = 0
    done = False
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > room:
                raise PayloadTooLarge(
                    f"blob {digest}: the body goes past the {room} bytes free on the models disk",
                    param="digest",
                )
            pending.append(chunk)
            pending_bytes += len(chunk)
            if pending_bytes >= WRITE_CHUNK:
                await asyncio.to_thread(writer.write, tuple(pending))
                pending, pending_bytes = [], 0
        if pending:
            await asyncio.to_thread(writer.write, tuple(pending))
        try:
            await asyncio.to_thread(writer.commit)
        except BlobMismatch as e:  # the partial is gone
            raise InvalidRequest(
                f'digest mismatch, expected "{digest}": {e.message}', param="digest"
            ) from None
        done = True
        log.info("blob %s: %d bytes received", digest, size)
    finally:
        if not done:
            writer.abort()
            writer.partial.unlink(missing_ok=True)
