"""`memspec serve`: settings, the bind check, the socket, uvicorn, signals, the exit status.

The socket is bound before anything loads, so a busy port or a refused address fails at once
with one line. SIGTERM/SIGINT start the app's graceful shutdown and the process exits 0 (not
by re-raising the signal, as uvicorn does by default); a failed model load exits 1.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError

from memspec.config import Settings
from memspec.net import is_loopback
from memspec.paths import use_data_dir
from memspec.server.app import Lifecycle, create_app
from memspec.server.auth import configured
from memspec.server.context import ServerContext
from memspec.server.engine_state import EngineState
from memspec.server.http import protocol_for
from memspec.server.state import TUNABLE, load_state, note_start, reject_state, state_path

log = logging.getLogger("memspec.server")


class BindRefused(ValueError):
    pass


def check_bind(settings: Settings) -> None:
    """A non-loopback bind needs a key, or an explicit --allow-insecure-bind."""
    if is_loopback(settings.host):
        return
    keys = (settings.api_key, settings.admin_key, *settings.api_keys)
    if any(configured(k) is not None for k in keys):
        return
    if settings.allow_insecure_bind:
        log.warning(
            "binding %s with no API or admin key: anyone on the network can use it", settings.host
        )
        return
    raise BindRefused(
        f"refusing to bind {settings.host} (not loopback) with no api_key or admin_key; "
        "set MEMSPEC_API_KEY / MEMSPEC_ADMIN_KEY, bind 127.0.0.1, or pass --allow-insecure-bind"
    )


def load_settings(config_file: str | Path | None, cli: dict[str, Any]) -> Settings:
    """CLI flags > tuned state file > env MEMSPEC_* > TOML > defaults."""
    return load_settings_and_base(config_file, cli)[0]


def load_settings_and_base(
    config_file: str | Path | None, cli: dict[str, Any], starting: bool = False
) -> tuple[Settings, Settings | None]:
    """The settings to start with, and the same without the tuned state (None when nothing
    is tuned): if the models cannot load with the tuned values, the daemon falls back to the
    configured ones instead of failing every restart. `starting` (the daemon): count this
    start, and move aside a tuned file that preceded `tune_failed_starts` failed starts."""
    cli = {k: v for k, v in cli.items() if v is not None}
    base = Settings.load(config_file, **cli)
    use_data_dir(base.data_dir)  # the daemon's models, data and state (not tunable)
    path = state_path(base)
    if starting:
        configure_logging(base.log_level)  # not tunable: the same level the daemon runs at
        failed, aside = note_start(path, base.tune_failed_starts)
        if aside is not None:
            log.error(
                "tuned settings %s were in place at the last %d starts, none of which got "
                "ready (failed or killed); moved aside as %s; starting on the configured "
                "settings",
                path,
                failed,
                aside,
            )
    tuned = {k: v for k, v in load_state(path).items() if k not in cli}
    if not tuned:
        return base, None
    try:
        settings = Settings.load(config_file, **tuned, **cli)
    except ValidationError as e:
        aside = reject_state(path)
        log.error("tuned settings in %s are invalid (%s); set aside as %s", path, e, aside)
        return base, None
    log.info("applying tuned settings from %s: %s", path, sorted(tuned))
    return settings, base


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


class Server(uvicorn.Server):
    """uvicorn with our shutdown phases, READY on listen, and exit 0 on SIGTERM."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, life: Lifecycle):
        super().__init__(config)
        self.ctx, self.life = ctx, life
        ctx.request_exit = self._request_exit

    def _request_exit(self, code: int) -> None:
        self.ctx.exit_code = code
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.life.on_listening()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.life.begin_shutdown_threadsafe()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a requested stop is a clean exit, not a re-raise


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def serve(
    config_file: str | Path | None = None,
    runtime_factory: Callable[[Settings], Any] | None = None,
    **cli: Any,
) -> int:
    """`runtime_factory`: builds the Runtime (default memspec.runtime.Runtime); the tests
    inject engine and load faults through it."""
    settings, configured_settings = load_settings_and_base(config_file, cli, starting=True)
    check_bind(settings)
    sock = bind_socket(settings.host, settings.port)
    app = create_app(settings, runtime_factory, fallback=configured_settings)
    ctx: ServerContext = app.state.memspec
    protocol = protocol_for(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
        lifespan="on",
        http=protocol,  # h11 with a header time limit and a connection cap
        limit_concurrency=protocol.max_connections,
    )
    server = Server(config, ctx, app.state.lifecycle)
    log.info(
        "memspec serve on %s:%d (target %s, tunable: %s, max %d connections)",
        settings.host,
        settings.port,
        settings.target,
        ", ".join(TUNABLE),
        protocol.max_connections,
    )
    server.run(sockets=[sock])
    state = ctx.worker.state
    if state not in (EngineState.STOPPED, EngineState.FAILED, EngineState.STARTING):
        # The engine thread is still inside llama.cpp: do not run interpreter teardown under
        # it. Still loading (a stop during start-up) is a clean exit; anything else is stuck.
        logging.shutdown()
        os._exit(ctx.exit_code if state is EngineState.LOADING else (ctx.exit_code or 1))
    return ctx.exit_code
