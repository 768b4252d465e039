"""Ollama's POST /api/pull, POST /api/push and DELETE /api/delete: a model from any registry
that speaks Ollama's protocol into memspec's own store (memspec.registry, memspec.pull), a
model of that store to a registry, and its removal.

All three change files or send them away, so they take the admin key when one is set
(`admin_key`, else `api_key`, as /admin does), not the API key: a chat client's key cannot fill
the disk, push a model or delete one. Ollama itself has no keys. As for /admin, the body must be
JSON (415 otherwise): a cross-site HTML form cannot send that (docs/security.md).

Wire behaviour follows Ollama's server (routes.go PullHandler, PushHandler, streamResponse,
waitForStream):
- streaming (the default) answers 200 with NDJSON progress; a failure after the first line,
  an unknown name included, is one {"error": "..."} line ("pull model manifest: file does not
  exist" for a name the registry lacks);
- "stream": false answers one {"status": "success"}, or 500 {"error": "..."};
- a name Ollama would refuse (memspec.ollama_name) is a 400 {"error": "invalid model name ..."}
  on every route, before any lookup;
- a valid name compares ignoring case, as Ollama's (getExistingName, OllamaStore.existing_name):
  `SmolLM2:Q8` pulls into, pushes or deletes the stored `smollm2:q8`, under that spelling;
- `insecure` speaks http to the registry, as Ollama's flag; `username`/`password` (Ollama's
  older fields) are Basic credentials for the registry's token or htpasswd auth, never logged;
- a second pull of a model already being pulled joins it (Ollama: "multiple calls will share
  the same download progress") and sees the progress so far;
- when every client of a pull has gone, the pull stops at its next buffer (Ollama cancels a
  blob download when its last waiter leaves); the partial blob stays, so the next pull resumes
  it with a Range request; no manifest is written until every blob is checked and in place;
- /api/delete removes a model of memspec's own store; one this daemon serves now is refused
  (400), as is one only in the adopted Ollama store (read-only); an unknown one is a 404.
The transfer runs on a thread of its own: it holds neither the event loop nor the engine. A
pulled model is servable as soon as its manifest is written (the catalog lists the store).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from memspec import ollama_name, registry
from memspec import pull as pulls
from memspec.errors import InvalidRequest, MemSpecError
from memspec.ollama_name import OllamaName
from memspec.ollama_store import StoreReadOnly, adopted_store, existing_name, own_store
from memspec.paths import models_dir, resolve_model_path
from memspec.server.auth import require_admin_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.errors import UnknownModel, UnsupportedMediaType

log = logging.getLogger("memspec.server")


async def require_json(request: Request) -> None:
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise UnsupportedMediaType(
            f"{request.url.path} changes files: send a JSON body with Content-Type: "
            f"application/json (got {kind[:80] or 'none'})",
            code="unsupported_media_type",
        )


router = APIRouter(
    tags=["ollama"], dependencies=[Depends(require_admin_key), Depends(require_json)]
)


class PullBody(BaseModel):
    # Go's JSON binding ignores fields it does not know; so do we (username, password, ...).
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # the older field name
    insecure: bool = False  # http to the registry, as Ollama's flag
    stream: bool = True
    username: str | None = None  # Basic credentials for the registry (Ollama's older fields)
    password: str | None = None


class PushBody(PullBody):
    pass


class DeleteBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None


async def read_body(request: Request, cls: type[BaseModel]) -> Any:
    """An Ollama route's JSON body as `cls`, or a 400 in Ollama's words."""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequest("missing request body")  # Ollama's words
    try:
        return cls.model_validate(json.loads(raw))
    except (ValueError, UnicodeDecodeError, ValidationError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else None
        where = ".".join(str(p) for p in first["loc"]) if first else "body"
        raise InvalidRequest(f"invalid value for {where}: {first['msg'] if first else e}") from None


def _asked(body: PullBody | DeleteBody) -> OllamaName:
    """The name asked for, checked as Ollama checks it (memspec.ollama_name): an invalid one
    (a path, a shell fragment, 5,000 characters) is a 400 before any lookup or file access."""
    name = body.model or body.name
    if not name or not name.strip():
        raise InvalidRequest("model is required", param="model")
    return ollama_name.parse(name)


# --- transfer jobs -------------------------------------------------------------------------

_DONE = object()  # a subscriber's queue ends with this


@dataclass
class TransferJob:
    """One pull (or push) running on its own thread; its clients subscribe to its progress."""

    label: str  # "pull NAME" / "push NAME", for the log
    work: Callable[[TransferJob], None]  # runs on the job's thread, emitting as it goes
    key: tuple[str, str, str]
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = field(
        default_factory=list
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: dict[str, Any]) -> None:  # the job's thread
        with self.lock:
            self.events.append(event)
            for loop, queue in self.subscribers:
                loop.call_soon_threadsafe(queue.put_nowait, event)

    def subscribe(self) -> asyncio.Queue[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self.lock:
            for event in self.events:  # what a late joiner missed
                queue.put_nowait(event)
            if self.done:
                queue.put_nowait(_DONE)
            else:
                self.subscribers.append((asyncio.get_running_loop(), queue))
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Any]) -> None:
        with self.lock:
            self.subscribers = [s for s in self.subscribers if s[1] is not queue]
            if not self.subscribers and not self.done:
                self.cancel.set()  # nobody is waiting: stop at the next buffer, as Ollama does
                log.info("%s: every client left; stopping", self.label)

    def run(self) -> None:
        try:
            self.work(self)
            log.info("%s: done", self.label)
        except (pulls.PullCancelled, pulls.ModelNotFound) as e:
            self.emit({"error": e.message})
        except MemSpecError as e:
            log.warning("%s failed: %s", self.label, e.message)
            self.emit({"error": e.message})
        except Exception as e:  # the disk, the network: one line, the log has the rest
            log.warning("%s failed", self.label, exc_info=True)
            self.emit({"error": f"{self.label}: {e}"})
        finally:
            with self.lock:
                self.done = True
                for loop, queue in self.subscribers:
                    loop.call_soon_threadsafe(queue.put_nowait, _DONE)
                self.subscribers = []
            with _jobs_lock:
                if _jobs.get(self.key) is self:
                    del _jobs[self.key]


_jobs: dict[tuple[str, str, str], TransferJob] = {}
_jobs_lock = threading.Lock()


def _job_key(verb: str, name: OllamaName) -> tuple[str, str, str]:
    return (verb, str(own_store().root), name.full)  # one job per store, model and direction


def _join_or_start(
    verb: str, name: OllamaName, work: Callable[[TransferJob], None]
) -> tuple[TransferJob, asyncio.Queue[Any]]:
    key = _job_key(verb, name)
    with _jobs_lock:
        job = _jobs.get(key)
        # A job whose clients all left stops; a new client starts a fresh one (which resumes).
        if job is None or job.cancel.is_set():
            job = TransferJob(f"{verb} {name.display}", work, key)
            _jobs[key] = job
            start = True
        else:
            start = False
        queue = job.subscribe()
    if start:
        threading.Thread(target=job.run, name=f"{verb}-{name.display}", daemon=True).start()
    return job, queue


async def _events(job: TransferJob, queue: asyncio.Queue[Any]) -> AsyncIterator[dict[str, Any]]:
    try:
        while (event := await queue.get()) is not _DONE:
            yield event
    finally:  # the client hung up (the stream is cancelled) or the job ended
        job.unsubscribe(queue)


async def _answer(job: TransferJob, queue: asyncio.Queue[Any], stream: bool) -> Response:
    if not stream:
        last: dict[str, Any] = {}
        async for event in _events(job, queue):
            if "error" in event:
                return JSONResponse({"error": event["error"]}, status_code=500)
            last = event
        return JSONResponse(last)

    async def lines() -> AsyncIterator[str]:
        async for event in _events(job, queue):
            yield json.dumps(event) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/api/pull")
async def pull(request: Request, ctx: Ctx) -> Response:
    body: PullBody = await read_body(request, PullBody)
    name = await asyncio.to_thread(own_store().existing_name, _asked(body))
    credentials = registry.Credentials.given(body.username, body.password)

    def work(job: TransferJob) -> None:
        pulls.pull(
            name, job.emit, insecure=body.insecure, credentials=credentials, cancel=job.cancel
        )
        if ctx.draft_builds is not None:  # servable now; its drafts are built in the background
            ctx.draft_builds.rescan()

    job, queue = _join_or_start("pull", name, work)
    return await _answer(job, queue, body.stream)


@router.post("/api/push")
async def push(request: Request) -> Response:
    body: PushBody = await read_body(request, PushBody)
    name = await asyncio.to_thread(own_store().existing_name, _asked(body))
    if own_store().read_manifest(name) is None:
        raise UnknownModel(f"model '{name.display}' not found", param="model")
    credentials = registry.Credentials.given(body.username, body.password)

    def work(job: TransferJob) -> None:
        registry.push(name, body.insecure, job.emit, credentials=credentials)

    job, queue = _join_or_start("push", name, work)
    return await _answer(job, queue, body.stream)


def _in_use(ctx: ServerContext) -> list[Path]:
    """The files this daemon serves from now: its target, every resident model, and their
    resident drafts' files."""
    used = [resolve_model_path(ctx.settings.target)]
    worker = ctx.worker
    targets = getattr(worker, "targets", None)
    runtimes = []
    # The engine thread may load or evict meanwhile: a copy, retried if torn.
    for _ in range(3):
        try:
            runtimes = list(targets.runtimes.values()) if targets is not None else []
            break
        except RuntimeError:
            continue
    if worker.runtime is not None and worker.runtime not in runtimes:
        runtimes.append(worker.runtime)
    for rt in runtimes:
        path = getattr(rt.target, "path", None)
        if path is not None:
            used.append(Path(path))
        ids: list[str] = []
        for _ in range(3):
            try:
                ids = list(rt.drafts)
                break
            except RuntimeError:
                continue
        for draft_id in ids:
            m = rt.manifests.get(draft_id)
            if m is not None and m.file:
                used.append(m.model_path(models_dir()))
    return used


def _resident_names(ctx: ServerContext) -> list[str]:
    """The names of the models resident now (the catalog's names)."""
    targets = getattr(ctx.worker, "targets", None)
    for _ in range(3):  # the engine thread may load or evict meanwhile
        try:
            return list(targets.runtimes) if targets is not None else []
        except RuntimeError:
            continue
    return []


@router.delete("/api/delete")
async def delete(request: Request, ctx: Ctx) -> Response:
    body: DeleteBody = await read_body(request, DeleteBody)
    adopted = adopted_store(ctx.settings)
    stores = (own_store(), adopted) if adopted is not None else (own_store(),)
    name = await asyncio.to_thread(existing_name, _asked(body), *stores)
    job = _jobs.get(_job_key("pull", name))
    if job is not None and not job.done:
        raise InvalidRequest(
            f"model '{name.display}' is being pulled; delete it when the pull ends",
            param="model",
        )
    try:
        removed = await asyncio.to_thread(
            pulls.delete,
            name,
            _in_use(ctx),
            adopted=adopted,
            serving=_resident_names(ctx),
        )
    except pulls.ModelNotFound:
        raise UnknownModel(f"model '{name.display}' not found", param="model") from None
    except (pulls.PullError, StoreReadOnly) as e:
        raise InvalidRequest(e.message, param="model", code=e.code) from None
    log.info("deleted %s: %d files", name.display, len(removed))
    return Response(status_code=200)  # Ollama answers an empty 200
