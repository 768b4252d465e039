"""The `memspec` command line: flags that mirror settings, help, one-line failures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from memspec.cli import main
from memspec.cli.flags import MODEL_SETTINGS, SERVE_SETTINGS, load_settings, settings_overrides
from memspec.cli.main import build_parser
from memspec.config import Settings
from memspec.paths import models_dir

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"  # a second tokenizer (262k tokens)
TESTBED_POOL = Path(__file__).resolve().parent.parent / "drafts"


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

    from memspec_lab.cli import build_parser as lab_parser

    # memspec's commands, the lab's listed among them, and the lab's own with their flags
    for path in [*commands(build_parser(), []), *commands(lab_parser(), [])]:
        with pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
        assert exit_.value.code == 0, path
    assert "--max-tokens" in capsys.readouterr().out


def test_a_lab_command_without_the_lab_says_how_to_install_it(monkeypatch, capsys):
    """`memspec bench ...` runs with the lab package (lab/); without it, one line and exit 2,
    and `memspec --help` still lists it."""
    import sys

    for name in [m for m in sys.modules if m == "memspec_lab" or m.startswith("memspec_lab.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "memspec_lab", None)  # not installed
    assert main(["bench", "batch", "--concurrency", "1,2", "--out", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "memspec bench needs the lab package: pip install -e lab/ (scripts/setup.sh installs it)\n"
    )
    assert main(["drafts", "eval", "--help"]) == 2
    assert capsys.readouterr().err.startswith("memspec drafts eval needs the lab package")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(f"    {name}" in out for name in ("bench", "testbed", "simulate", "traces"))


def test_a_failure_is_one_line_on_stderr(tmp_path, capsys):
    rc = main(["generate", "--prompt", "p", "--json", "--config", str(tmp_path / "no.toml")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("memspec: error: config file not found")
    assert err.count("\n") == 1


def _require_gemma() -> None:
    try:
        from launcher import require_gemma
    except ImportError:  # until tests/launcher.py has the shared helper
        if not (models_dir() / GEMMA_FILE).is_file():
            pytest.skip(f"{GEMMA_FILE} missing: run `memspec testbed fetch --family gemma3`")
    else:
        require_gemma()


@pytest.fixture()
def testbed_pool(tmp_path, monkeypatch):
    """A manifest dir with the testbed's q4_0 and prompt-lookup (not a target's own family)."""
    for name in ("q4_0.toml", "prompt-lookup.toml"):
        (tmp_path / name).write_text((TESTBED_POOL / name).read_text())
    monkeypatch.setenv("MEMSPEC_MANIFEST_DIR", str(tmp_path))


@pytest.mark.models
def test_drafts_list_checks_the_targets_tokenizer(capsys, testbed_pool):
    assert main(["drafts", "list", "--json"]) == 0  # the testbed target: its own drafts fit
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["q4_0"]["compatible"] is True and rows["q4_0"]["reason"] is None
    _require_gemma()
    assert main(["drafts", "list", "--target", GEMMA_FILE]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"target {GEMMA_FILE}: a llama tokenizer of 262144 tokens")
    assert "q4_0: not usable with this target: built for a gpt2 tokenizer of 49152" in out
    assert main(["drafts", "list", "--json", "--target", GEMMA_FILE]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["q4_0"]["compatible"] is False and "262144" in rows["q4_0"]["reason"]
    assert rows["prompt-lookup"]["compatible"] is True  # no tokenizer: speaks any


def test_generate_with_an_incompatible_draft_is_one_line(capsys, testbed_pool):
    _require_gemma()
    argv = ["generate", "--prompt", "p", "--draft", "q4_0", "--target", GEMMA_FILE]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("memspec: error: draft 'q4_0' cannot serve this target: built for a gpt2")


def test_benches_learn_in_a_state_dir_of_their_own(tmp_path, monkeypatch):
    """A bench's runtimes neither read nor write what the box learnt (<data>/state/learned):
    a temporary state directory, unless one is configured."""
    from memspec_lab.cli import bench_settings
    from memspec_lab.cli import build_parser as lab_parser

    argv = ["bench", "engine", "--out", str(tmp_path / "o.json")]
    fresh = bench_settings(lab_parser().parse_args(argv))
    assert fresh.state_dir is not None and fresh.state_dir.is_dir()
    assert not any(fresh.state_dir.iterdir())
    assert fresh.state_dir != bench_settings(lab_parser().parse_args(argv)).state_dir
    monkeypatch.setenv("MEMSPEC_STATE_DIR", str(tmp_path / "mine"))
    assert bench_settings(lab_parser().parse_args(argv)).state_dir == tmp_path / "mine"
