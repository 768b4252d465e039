"""Settings: loaded once, then frozen; loading reads the environment and never writes it."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from memspec.config import Settings


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("MEMSPEC_"):
            monkeypatch.delenv(key)


def test_settings_are_frozen_after_load(clean_env, tmp_path):
    s = Settings.load(k_max=4, data_dir=tmp_path)
    with pytest.raises(ValidationError):
        s.k_max = 6
    with pytest.raises(ValidationError):
        s.budget = "1GiB"
    assert s.k_max == 4
    # A variant is a copy; the original stays as loaded.
    tuned = s.model_copy(update={"k_max": 6})
    assert (tuned.k_max, s.k_max) == (6, 4)


def test_load_does_not_write_the_environment(clean_env, tmp_path):
    s = Settings.load(data_dir=tmp_path)
    assert s.data_dir == tmp_path
    assert "MEMSPEC_DATA_DIR" not in os.environ


def test_env_still_configures(clean_env, monkeypatch):
    monkeypatch.setenv("MEMSPEC_K_MAX", "3")
    assert Settings.load().k_max == 3


def test_exactness_is_bitwise_unless_numeric_is_asked_for(clean_env, monkeypatch, tmp_path):
    assert Settings.load().exactness == "bitwise"
    monkeypatch.setenv("MEMSPEC_EXACTNESS", "numeric")
    assert Settings.load().exactness == "numeric"
    monkeypatch.delenv("MEMSPEC_EXACTNESS")  # the environment outranks the file
    toml = tmp_path / "c.toml"
    toml.write_text('exactness = "close-enough"\n')
    with pytest.raises(ValidationError, match="exactness must be one of bitwise, numeric"):
        Settings.load(toml)
