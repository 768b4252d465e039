"""The FastAPI app: factory, lifespan, /health, /metrics; routes live in their own modules.

Lifespan: the engine thread starts loading the models while the HTTP server already answers
(/health 503 until ready). READY=1 goes to systemd once the models are loaded *and* the port
listens; the watchdog pings from then on while the engine beats. Shutdown (SIGTERM): stop
accepting, fail what waits, let the running generation finish for `shutdown_grace_s`, then cut
it (its stream ends with finish_reason "cancelled"), close the models, STOPPING=1, exit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

import memspec
from memspec.config import Settings
from memspec.draft_builds import DraftBuilds
from memspec.server import (
    admin,
    embeddings_api,
    ollama_api,
    ollama_create,
    ollama_extra,
    ollama_pull,
    openai_api,
)
from memspec.server.auth import fully_keyed
from memspec.server.context import Ctx, ServerContext
from memspec.server.engine_state import EngineState
from memspec.server.errors import error_body, install_error_handlers
from memspec.server.metrics import CONTENT_TYPE, LiveValues, Metrics
from memspec.server.middleware import BodyLimit, HostGuard, RequestMetrics
from memspec.server.notify import Notifier
from memspec.server.state import start_ready
from memspec.server.worker import EngineWorker
from memspec.units import parse_size

log = logging.getLogger("memspec.server")


class Lifecycle:
    """READY once (models loaded and port listening), shutdown phases, fatal errors."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._ready_sent = False
        self._cut: asyncio.TimerHandle | None = None

    def on_listening(self) -> None:
        self.ctx.listening = True
        self._maybe_ready()

    def on_engine_ready(self) -> None:  # engine thread
        if self.ctx.worker.state is EngineState.READY:
            log.info("models loaded; engine ready")
            if self._ready_sent:  # READY went out while it waited for a device
                self.ctx.notifier.status(f"serving {self.ctx.model_id}")
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        ctx = self.ctx
        with self._lock:
            # Waiting for an RPC worker counts as started: the daemon answers (503 with the
            # reason) and loads when the worker does; systemd must not time the start out.
            if (
                self._ready_sent
                or ctx.shutting_down
                or not ctx.listening
                or ctx.worker.state not in (EngineState.READY, EngineState.WAITING_FOR_DEVICE)
            ):
                return
            self._ready_sent = True
        start_ready(ctx.worker.tuning.path)  # the tuned state, if any, can start
        if ctx.worker.state is EngineState.WAITING_FOR_DEVICE:
            ctx.notifier.ready(f"waiting for a device: {ctx.worker.error}")
            log.info("started; waiting for a device: %s", ctx.worker.error)
            return
        ctx.notifier.ready(f"serving {ctx.model_id}")
        log.info("ready: serving %s", ctx.model_id)

    def on_fatal(self, exc: BaseException) -> None:  # engine thread
        self.ctx.exit_code = 1
        self.ctx.notifier.status(f"failed: {getattr(exc, 'message', exc)}")
        if self.ctx.request_exit is not None:
            self.ctx.request_exit(1)

    def begin_shutdown(self) -> None:
        """Event-loop thread: stop accepting; cut the running generation after the grace."""
        ctx = self.ctx
        if ctx.shutting_down:
            return
        ctx.shutting_down = True
        ctx.notifier.stopping()
        ctx.worker.stop_accepting()
        grace = ctx.settings.shutdown_grace_s
        log.info("shutting down: in-flight generation gets %.1fs", grace)
        if grace <= 0 or self.loop is None:
            ctx.worker.cancel_running()
        else:
            self._cut = self.loop.call_later(grace, ctx.worker.cancel_running)

    def begin_shutdown_threadsafe(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.begin_shutdown)


def _live_values(ctx: ServerContext) -> Callable[[], LiveValues]:
    def read() -> LiveValues:
        return LiveValues(
            budget_bytes=ctx.worker.budget_bytes,
            queue_depth=ctx.worker.queue_depth,
            active_slots=ctx.worker.active_slots,
            slots=ctx.worker.slots,
            prefix_cache_bytes=ctx.worker.prefix_cache.nbytes,
            drafts=admin.draft_rows(ctx),
        )

    return read


def create_app(
    settings: Settings,
    runtime_factory: Callable[[Settings], Any] | None = None,
    environ: dict[str, str] | None = None,
    fallback: Settings | None = None,
) -> FastAPI:
    """`fallback`: the settings without the tuned state, tried if the tuned ones cannot load."""
    metrics = Metrics()
    ctx = ServerContext(
        worker=EngineWorker(settings, metrics, runtime_factory, fallback=fallback),
        metrics=metrics,
        notifier=Notifier(environ),
    )
    # Drafts for whatever arrives: built in the background once the engine serves.
    ctx.draft_builds = DraftBuilds(lambda: ctx.worker.settings, ctx.worker.catalog)
    life = Lifecycle(ctx)
    ctx.worker._on_ready = life.on_engine_ready
    ctx.worker._on_fatal = life.on_fatal
    metrics.attach(_live_values(ctx))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        life.loop = asyncio.get_running_loop()
        ctx.notifier.status("loading models")
        ctx.worker.start()
        ctx.draft_builds.start(ready=lambda: ctx.worker.ready)
        watchdog = asyncio.create_task(ctx.notifier.watchdog_loop(ctx.worker.healthy))
        try:
            yield
        finally:
            life.begin_shutdown()
            watchdog.cancel()
            await asyncio.to_thread(ctx.draft_builds.close)  # its child stops, to resume later
            stopped = await asyncio.to_thread(ctx.worker.stop, 10.0)
            if not stopped:
                log.error("the engine thread did not stop; exiting without closing models")
                ctx.exit_code = ctx.exit_code or 1
            ctx.notifier.close()

    app = FastAPI(
        title="MemSpec",
        version=memspec.__version__,
        description="OpenAI-compatible speculative decoding daemon for memory-starved devices",
        lifespan=lifespan,
    )
    app.state.memspec = ctx
    app.state.lifecycle = life
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(openai_api.llama_router)
    app.include_router(admin.router)
    app.include_router(ollama_api.router)
    app.include_router(ollama_api.open_router)
    app.include_router(embeddings_api.router)
    app.include_router(embeddings_api.ollama_router)
    app.include_router(ollama_pull.router)
    app.include_router(ollama_create.router)
    app.include_router(ollama_create.blob_router)
    app.include_router(ollama_extra.router)  # the rest of Ollama's routes: none is a 404
    app.include_router(ollama_extra.open_router)

    @app.get("/health", tags=["daemon"])
    async def health(ctx: Ctx) -> JSONResponse:
        w = ctx.worker
        if ctx.shutting_down:
            state = "shutting_down"
        elif w.state is EngineState.READY and ctx.listening:
            return JSONResponse({"status": "ok", "model": ctx.model_id, "uptime_s": ctx.uptime_s})
        else:
            state = w.state
        message = f"not ready: {state}" + (f" ({w.error})" if w.error else "")
        body = {"status": state} | error_body(message, "server_error", code="not_ready")
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})

    @app.get("/metrics", tags=["daemon"])
    async def prometheus(ctx: Ctx) -> Response:
        body = await asyncio.to_thread(ctx.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    # Outermost first: count every request, refuse foreign hosts and origins, then oversize
    # or slow bodies.
    app.add_middleware(
        BodyLimit,
        limit=parse_size(settings.max_body),
        timeout_s=settings.body_timeout_s,
        streamed=ollama_create.STREAMED_PATHS,
    )
    app.add_middleware(
        HostGuard,
        keyed=fully_keyed(settings),
        bind_host=settings.host,
        allowed_hosts=settings.allowed_hosts,
        cors_origins=settings.cors_origins,
    )
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app
