"""What every route needs: settings, the engine worker, metrics, the notifier, lifecycle flags.

The settings are the engine worker's: frozen, and replaced by its Tuning when tuned live.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from memspec.config import Settings
from memspec.draft_builds import DraftBuilds
from memspec.memory.plan import trained_context
from memspec.paths import resolve_model_path
from memspec.server.errors import as_memspec_error
from memspec.server.metrics import Metrics
from memspec.server.notify import Notifier
from memspec.server.worker import ControlJob, Done, EngineWorker, Failed


@dataclass
class ServerContext:
    worker: EngineWorker
    metrics: Metrics
    notifier: Notifier
    started_at: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    listening: bool = False
    shutting_down: bool = False
    exit_code: int = 0
    request_exit: Callable[[int], None] | None = None  # set by the process runner
    draft_builds: DraftBuilds | None = None  # drafts for whatever arrives (create_app)
    _model_id: str | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        """The settings now (the tuned ones, as the engine runs with them)."""
        return self.worker.settings

    @property
    def model_id(self) -> str | None:
        """The name the default target is served as: None until it has first loaded, then
        kept while it reloads or is unloaded (the catalog names it without loading it)."""
        if self._model_id is None and self.worker.targets.runtimes:
            self._model_id = self.worker.default_model
        return self._model_id

    @property
    def n_ctx(self) -> int:
        """The context per slot the target runs: n_ctx "auto" resolved by its runtime; until
        it has loaded, the configured one (auto: its most, the trained context)."""
        rt = self.worker.runtime
        if rt is not None:
            return rt.target.n_ctx
        n_ctx = self.settings.n_ctx
        return (
            int(n_ctx)
            if n_ctx != "auto"
            else trained_context(resolve_model_path(self.settings.target))
        )

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_mono

    async def control(self, fn: Callable[[EngineWorker], Any], name: str) -> Any:
        """Run fn(worker) on the engine thread, between generations; its result or its error."""
        job = ControlJob(asyncio.get_running_loop(), fn, name)
        self.worker.submit(job)
        while True:
            ev = await job.next_event()
            if isinstance(ev, Done):
                return ev.result
            if isinstance(ev, Failed):
                raise as_memspec_error(ev.error)


def get_context(request: Request) -> ServerContext:
    return request.app.state.memspec


Ctx = Annotated[ServerContext, Depends(get_context)]
