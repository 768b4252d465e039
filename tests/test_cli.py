"""The `memspec` command line: flags that mirror settings, help, one-line failures."""

from __future__ import annotations

import argparse

import pytest

from memspec.cli import main
from memspec.cli.flags import MODEL_SETTINGS, SERVE_SETTINGS, load_settings, settings_overrides
from memspec.cli.main import build_parser
from memspec.config import Settings


@pytest.fixture(autouse=True)
def _no_env_settings(monkeypatch):
    monkeypatch.delenv("MEMSPEC_DATA_DIR", raising=False)
    for name in Settings.model_fields:
        monkeypatch.delenv(f"MEMSPEC_{name.upper()}", raising=False)


def test_model_flags_become_settings():
    argv = ["generate", "--prompt", "p", "--drafts", "q8_0,,prompt-lookup", "--n-ctx", "512"]
    settings = load_settings(build_parser().parse_args([*argv, "--backend", "torch"]))
    assert settings.drafts == ["q8_0", "prompt-lookup"]
    assert (settings.n_ctx, settings.backend) == (512, "torch")
    assert settings.k_max == Settings.model_fields["k_max"].default  # a flag left out: no say


def test_serve_flags_are_the_server_settings():
    args = build_parser().parse_args(["serve", "--allow-insecure-bind", "--max-queue", "3"])
    assert settings_overrides(args) == {"allow_insecure_bind": True, "max_queue": 3}
    assert set(MODEL_SETTINGS + SERVE_SETTINGS) <= set(vars(args))


def test_every_command_has_help(capsys):
    def commands(parser: argparse.ArgumentParser, path: list[str]):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from commands(sub, [*path, name])

    for path in commands(build_parser(), []):
        with pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
        assert exit_.value.code == 0, path
    assert "--max-tokens" in capsys.readouterr().out


def test_a_failure_is_one_line_on_stderr(tmp_path, capsys):
    rc = main(["generate", "--prompt", "p", "--json", "--config", str(tmp_path / "no.toml")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("memspec: error: config file not found")
    assert err.count("\n") == 1
