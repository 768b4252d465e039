"""`memspec drafts eval` on the real target: one prompt, short, JSON + plot written."""

from __future__ import annotations

import json

import pytest

from memspec.cli import main
from memspec.paths import models_dir


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
