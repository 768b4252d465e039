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
