"""`memspec bench engine` on the real target: the configs asked for, against plain decoding."""

from __future__ import annotations

import json

import pytest

from memspec.cli import main
from memspec_lab.bench.engine import decode_ms_per_token

ARGS = [
    "bench", "engine", "--workload", "heldout", "--categories", "code", "--per-category", "1",
    "--max-tokens", "16", "--n-ctx", "1024", "--n-threads", "1", "--drafts", "prompt-lookup,q4_0",
    "--no-peer-server",
]  # fmt: skip


@pytest.mark.slow
def test_bench_engine_only_the_configs_asked_for(tmp_path, settings):
    out = tmp_path / "engine.json"
    assert main([*ARGS, "--out", str(out), "--configs", "memspec,q4_0 adaptive-k"]) == 0
    report = json.loads(out.read_text())
    assert report["all_identical"] is True
    section = report["workloads"]["heldout"]
    # Plain decoding always runs: it is what the speedups are ratios to.
    assert set(section["configs"]) == {"none", "memspec", "q4_0 adaptive-k"}
    for name, entry in section["configs"].items():
        (run,) = entry["runs"]
        assert run["category"] == "code" and run["tokens"] == 16, name
        assert run["identical"] is True, name
        # Decoding's share per token: less than the whole (the prompt's share taken out).
        overall = entry["overall"]
        whole_ms = overall["seconds"] / overall["tokens"] * 1e3
        assert 0 < overall["decode_ms_per_token"] < whole_ms, name
    assert section["configs"]["q4_0 adaptive-k"]["runs"][0]["drafts_used"].keys() <= {"q4_0"}


def test_bench_engine_unknown_config_names_the_known_ones(tmp_path, settings, capsys):
    assert main([*ARGS, "--out", str(tmp_path / "x.json"), "--configs", "memspec,bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench configs ['bogus']" in err and "q4_0 adaptive-k" in err
    assert not (tmp_path / "x.json").exists()


def test_decode_time_per_token_needs_every_rows_prompt_share():
    rows = [
        {"seconds": 2.0, "prefill_s": 1.0, "tokens": 10},
        {"seconds": 1.0, "prefill_s": 0.5, "tokens": 5},
    ]
    assert decode_ms_per_token(rows) == 100.0
    # A peer that times only the whole (llama-cpp-python's prompt lookup): not guessed.
    assert decode_ms_per_token([*rows, {"seconds": 1.0, "tokens": 5}]) is None
    assert decode_ms_per_token([]) is None
