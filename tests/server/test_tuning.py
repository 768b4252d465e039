"""Live tuning (memspec.server.tuning) on a worker whose models are not loaded: the values,
the tuned file, reset, and the start-up fallback; settings objects are never changed in place."""

from __future__ import annotations

import json
import os

import pytest

from memspec.config import Settings
from memspec.server.engine_state import EngineState, state_error
from memspec.server.worker import EngineWorker


@pytest.fixture
def settings(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("MEMSPEC_"):
            monkeypatch.delenv(key)
    return Settings.load(state_dir=tmp_path / "state", k_max=8, policy="auto")


@pytest.mark.models
def test_tune_replaces_settings_and_persists(settings):
    worker = EngineWorker(settings)  # not started: no runtime
    tuning = worker.tuning
    tuning.tune(worker, {"k_max": 3, "budget": "1GiB"})
    assert worker.settings.k_max == 3 and worker.budget_bytes == 2**30
    assert settings.k_max == 8  # the loaded settings are as they were
    saved = json.loads(tuning.path.read_text())
    assert saved == {"budget": "1GiB", "k_max": 3}
    tuning.tune(worker, {"policy": "memspec"})  # merged into the file
    assert json.loads(tuning.path.read_text()) == {
        "budget": "1GiB",
        "policy": "memspec",
        "k_max": 3,
    }
    assert tuning.reset(worker) == ["budget", "k_max", "policy"]
    assert worker.settings.k_max == 8 and worker.settings.policy == "auto"
    assert not tuning.path.exists()


def test_a_failed_start_falls_back_to_the_configured_values(settings):
    tuned = settings.model_copy(update={"k_max": 2, "n_ctx": 4096})
    worker = EngineWorker(tuned, fallback=settings)
    assert worker.tuning.fall_back() == ["k_max", "n_ctx"]
    assert (worker.settings.k_max, worker.settings.n_ctx) == (8, settings.n_ctx)


def test_every_refusing_state_has_one_error():
    assert state_error(EngineState.READY, None) is None
    assert state_error(EngineState.RELOADING, None) is None
    assert state_error(EngineState.LOADING, None).code == "model_loading"
    assert state_error(EngineState.FAILED, "x").code == "model_load_failed"
    assert "gone" in state_error(EngineState.DEVICE_LOST, "gone").message
