"""The engine worker's start-up checks, on a runtime whose fault is injected on purpose."""

from __future__ import annotations

from memspec.config import Settings
from memspec.server.worker import EngineWorker


class BatchDependentTarget:
    """A target whose kernels depend on the batch shape (llamafile sgemm, GPU kernels)."""

    def describe(self) -> dict[str, object]:
        return {"backend": "injected", "batch_invariant": False}


class RuntimeWith:
    def __init__(self, target: object):
        self.target = target
        self.policies = {"auto": None, "memspec": None}


def test_a_batch_dependent_target_is_a_status_warning():
    worker = EngineWorker(Settings(), runtime_factory=lambda s: RuntimeWith(BatchDependentTarget()))
    worker._first_load()
    assert any("not known to be batch-invariant" in w for w in worker.warnings), worker.warnings


def test_a_batch_dependent_target_asked_for_is_no_warning():
    """exactness = numeric turns the row rule off on purpose: /admin/status says which mode
    runs (kernels.exactness), and nothing warns about what the operator chose."""
    settings = Settings(exactness="numeric")
    worker = EngineWorker(settings, runtime_factory=lambda s: RuntimeWith(BatchDependentTarget()))
    worker._first_load()
    assert worker.warnings == []


def test_a_batch_invariant_target_adds_no_warning(small_backend):
    worker = EngineWorker(Settings(), runtime_factory=lambda s: RuntimeWith(small_backend))
    worker._first_load()
    assert small_backend.describe()["batch_invariant"] is True
    assert worker.warnings == []


class CalibratingRuntime:
    """A runtime whose calibration was left for idle time: a timed pass per stop() check."""

    def __init__(self, on_pass: object = None):
        self.passes, self.on_pass = 0, on_pass

    def calibrate_pending(self, stop) -> bool:
        while not stop():
            self.passes += 1
            if self.on_pass is not None:
                self.on_pass(self.passes)
        return False


def test_calibration_runs_only_while_nothing_waits_and_stops_for_a_request():
    worker = EngineWorker(Settings(), runtime_factory=lambda s: RuntimeWith(None))
    queued: list[object] = []

    def request_comes(passes: int) -> None:  # a request arrives during the third pass
        if passes == 3:
            worker._queue.append(queued.pop())

    rt = CalibratingRuntime(request_comes)
    worker.targets.runtimes["new:1b"] = rt  # type: ignore[assignment]
    worker._queue.append(object())  # a request waits: its first token before any calibration
    worker._calibrate_while_idle()
    assert rt.passes == 0
    queued.append(worker._queue.popleft())  # admitted and answered: the engine is idle
    beat = worker.heartbeat
    worker._calibrate_while_idle()
    assert rt.passes == 3  # the request waited for the pass in hand, not the rest
    assert worker.heartbeat > beat  # a beat per pass: a long calibration is no stuck engine
