"""`memspec bench cold` on the real target: each config's generation from a fresh runtime."""

from __future__ import annotations

import json

import pytest

from memspec.cli import main


@pytest.mark.slow
def test_bench_cold_cli(tmp_path, settings):
    out = tmp_path / "cold.json"
    rc = main(
        [
            "bench", "cold", "--out", str(out), "--workload", "heldout", "--categories", "code",
            "--per-category", "1", "--max-tokens", "24", "--n-ctx", "1024", "--n-threads", "1",
            "--drafts", "prompt-lookup,q4_0",
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["all_identical"] is True
    section = report["workloads"]["heldout"]
    assert set(section["configs"]) == {"none", "memspec", "auto"}
    for name, entry in section["configs"].items():
        (run,) = entry["runs"]
        assert run["category"] == "code" and run["tokens"] == 24, name
        assert "q4_0" in run["resident_at_end"], name  # preloaded by each fresh runtime
        assert entry["overall"]["speedup"] > 0
    assert section["configs"]["none"]["runs"][0]["proposed"] == 0
