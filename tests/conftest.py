"""Shared fixtures: the real testbed models (built by scripts/setup.sh), loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launcher import (
    GEMMA_DRAFTS,
    MODEL_DRAFTS,
    QUICK,
    TARGET_FILE,
    require_gemma,
    require_testbed,
)

from memspec import paths
from memspec.backends.base import BackendOptions, load_backend
from memspec.config import Settings
from memspec.paths import models_dir

PROMPTS = [
    # extraction: prompt lookup should accept a lot
    "Extract the names from this sentence: Alice met Bob and Carol at the station, "
    "then Alice and Carol took the train.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three benefits of regular exercise?",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The quick tier (scripts/test.sh --quick) has no models: a test marked `models` skips
    before its fixtures load any (those calling launcher.require_* skip by themselves)."""
    if not QUICK:
        return
    skip = pytest.mark.skip(reason="needs real models: scripts/test.sh runs it, --quick does not")
    for item in items:
        if item.get_closest_marker("models") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory) -> Path:
    """Runtimes made here keep tuned and learnt state (memspec.scheduler.learned) in a dir of
    the session's own: what a developer's daemon learnt never steers a test."""
    path = tmp_path_factory.mktemp("state")
    os.environ["MEMSPEC_STATE_DIR"] = str(path)
    os.environ.setdefault("MEMSPEC_OLLAMA_MODELS", "none")  # nobody's own Ollama store either
    os.environ.setdefault("MEMSPEC_BUILD_DRAFTS", "false")  # no background builds of data/
    return path


@pytest.fixture(autouse=True)
def data_dir_as_it_was():
    """Loading settings for a command hands their data_dir to memspec.paths for the process
    (paths.use_data_dir); the next test starts from what was there before, as monkeypatch
    puts the environment back."""
    before = paths._chosen
    yield
    paths.use_data_dir(before)


@pytest.fixture(scope="session")
def settings() -> Settings:
    require_testbed()
    return Settings.load(drafts=["prompt-lookup", *MODEL_DRAFTS], n_ctx=1024)


@pytest.fixture(scope="session")
def runtime(settings):
    from memspec.runtime import Runtime

    rt = Runtime(settings)
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def gemma_runtime():
    """Gemma 3 270M (vocabulary 262,144) as the target, with its own derived pool."""
    from memspec.runtime import Runtime

    target = require_gemma()
    rt = Runtime(Settings.load(target=str(target), drafts=GEMMA_DRAFTS, n_ctx=1024))
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def chat_prompts(runtime) -> list[list[int]]:
    return [
        runtime.requests.prompt_tokens(messages=[{"role": "user", "content": p}]) for p in PROMPTS
    ]


@pytest.fixture()
def small_backend():
    """A fresh llama.cpp target with a small context, for KV-level tests."""
    require_testbed()
    be = load_backend(models_dir() / TARGET_FILE, BackendOptions(n_ctx=256))
    yield be
    be.close()
