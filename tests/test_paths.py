"""Where models and data live: the loaded settings' data_dir, else $MEMSPEC_DATA_DIR, else the
checkout's data/."""

from __future__ import annotations

from memspec import paths


def test_the_loaded_settings_data_dir_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMSPEC_DATA_DIR", str(tmp_path / "env"))
    paths.use_data_dir(None)
    assert paths.models_dir() == tmp_path / "env" / "models"
    paths.use_data_dir(tmp_path / "toml")  # e.g. data_dir in the config file
    assert paths.models_dir() == tmp_path / "toml" / "models"
    monkeypatch.delenv("MEMSPEC_DATA_DIR")
    paths.use_data_dir(None)
    assert paths.data_dir().name == "data"
