"""`memspec serve` with faults injected on purpose, through EngineWorker's runtime_factory: the
real daemon otherwise. launcher.start(faults=True) runs it with serve()'s settings as JSON.

A prompt containing one of these markers triggers its fault as its sequence starts
(Runtime.open_sequence) or inside its rounds, on the engine thread, exactly where a real
engine failure would happen:

    FAULT:raise      raise before the first token (the request gets a clean 500)
    FAULT:midstream  raise at the third token (the stream ends with an error event)
    FAULT:slow       sleep 0.1 s per token (holds the engine: queue and disconnect tests)
    FAULT:hang       never return (a stuck engine: watchdog pings must stop)
    FAULT:die        raise SystemExit on the engine thread (a bug no request handler catches:
                     /health must say why and the daemon exit non-zero, for systemd to restart)

FAULT_LOAD_DELAY_S=N in the environment makes building the runtime take N s longer (only for
targets whose file name contains FAULT_SLOW_LOAD_MODEL, when that is set); while the
file <MEMSPEC_DATA_DIR>/fault-raise-<draft id> exists, loading that draft raises inside the
working set's loader (the test creates and removes the file while the daemon runs).

It decodes one sequence at a time (`parallel` 1: a FAULT:slow request holds the engine) unless
the test's settings name `parallel`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from memspec.config import Settings
from memspec.engine.speculative import Sequence
from memspec.paths import data_dir
from memspec.runtime import Runtime
from memspec.server.serve import serve


class FaultySource:
    """A draft source whose loads raise while the draft's marker file exists."""

    def __init__(self, base: Any):
        self._base = base

    def load_draft(self, draft_id: str) -> Any:
        if (data_dir() / f"fault-raise-{draft_id}").exists():
            raise RuntimeError(f"injected draft load fault ({draft_id})")
        return self._base.load_draft(draft_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


class FaultyRuntime(Runtime):
    # Runtime.__init__ sets its draft source before building the working set from it: wrap
    # it as it is set, so every load (the preload too) goes through FaultySource.
    @property
    def draft_source(self) -> Any:
        return self._faulty_source

    @draft_source.setter
    def draft_source(self, source: Any) -> None:
        self._faulty_source = FaultySource(source)

    def open_sequence(
        self, req: Any, slot: int = 0, on_token: Any = None, cancel: Any = None, alone: bool = True
    ) -> Sequence:
        text = self.target.detokenize(req.prompt).decode("utf-8", errors="replace")
        if "FAULT:raise" in text:
            raise RuntimeError("injected engine fault")
        if "FAULT:hang" in text:
            threading.Event().wait()
        if "FAULT:die" in text:
            raise SystemExit("injected engine death")
        if on_token is not None and ("FAULT:midstream" in text or "FAULT:slow" in text):
            count = 0
            midstream = "FAULT:midstream" in text

            def faulty(delta: str, token: int | None) -> None:
                nonlocal count
                count += 1
                if midstream and count == 3:
                    raise RuntimeError("injected engine fault mid-stream")
                if not midstream:
                    time.sleep(0.1)
                on_token(delta, token)

            return super().open_sequence(req, slot, faulty, cancel, alone)
        return super().open_sequence(req, slot, on_token, cancel, alone)


def runtime_factory(settings: Settings) -> Runtime:
    slow = os.environ.get("FAULT_SLOW_LOAD_MODEL")
    if not slow or slow in Path(settings.target).name:
        time.sleep(float(os.environ.get("FAULT_LOAD_DELAY_S", "0")))
    return FaultyRuntime(settings, batched=True)


if __name__ == "__main__":
    chosen = {"parallel": 1} | json.loads(sys.argv[1])
    sys.exit(serve(None, runtime_factory=runtime_factory, **chosen))
