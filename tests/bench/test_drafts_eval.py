"""`memspec drafts eval` on the real target: one prompt, short, JSON + plot written."""

from __future__ import annotations

import json

import pytest

from memspec.cli import main
from memspec.paths import models_dir


@pytest.mark.slow
def test_drafts_eval_cli(tmp_path, settings):
    draft = "datastore-ci"
    if not (models_dir() / f"{draft}.npz").is_file():
        pytest.fail(f"{draft} not built: run `memspec drafts build`", pytrace=False)
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    rc = main(
        [
            "drafts", "eval", "--out", str(out), "--plot", str(png), "--per-category", "1",
            "--categories", "coding", "writing", "--max-tokens", "16", "--n-ctx", "1024",
            "--n-threads", "1",
            "--only", f"prompt-lookup,{draft}",
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["all_identical"] is True
    assert set(report["drafts"]) == {"none", "prompt-lookup", draft}
    ds = report["drafts"][draft]
    assert ds["kind"] == "datastore" and ds["bytes"] > 0
    assert set(ds["per_category"]) == {"coding", "writing"}
    for cat in ds["per_category"].values():
        assert cat["identical_to_plain"] and cat["speedup"] > 0
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_drafts_replay_only_cli(tmp_path, settings):
    """--replay-only: lookup drafts asked at every position, a model draft teacher-forced."""
    out = tmp_path / "replay.json"
    rc = main(
        [
            "drafts", "eval", "--replay-only", "--out", str(out), "--per-category", "1",
            "--categories", "coding", "writing", "--max-tokens", "24", "--n-ctx", "1024",
            "--n-threads", "1", "--only", "prompt-lookup,q8_0",
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "drafts-replay" and report["prompts"] == 2
    q8 = report["drafts"]["q8_0"]
    # The Q8_0 self-draft agrees with its F32 target almost everywhere, and always proposes.
    assert q8["overall"]["coverage"] == 1.0
    assert q8["overall"]["first_token_acceptance"] > 0.8
    pl = report["drafts"]["prompt-lookup"]["overall"]
    assert 0.0 <= pl["coverage"] < 1.0 and 0.0 <= pl["first_token_acceptance"] <= 1.0
