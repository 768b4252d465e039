"""`memspec bench kernels` on Gemma 3 270M Q4_K_M: the report's shape, and that the row rule is
what keeps repacked weights and the tiled matmul bit-exact (timings are the bench's to report,
not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_kernels_bench_reports_which_configs_are_bit_exact(tmp_path):
    from launcher import require_gemma

    target = require_gemma()
    out = tmp_path / "kernels.json"
    done = subprocess.run(
        [sys.executable, "-m", "memspec.cli", "bench", "kernels", str(target), "--n-threads",
         "1", "--prompt-tokens", "48", "--decode-tokens", "27", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["targets"][target.name]
    assert list(rows) == ["plain", "repack+rule", "repack+tiled+rule", "repack", "repack+tiled"]
    assert not rows["plain"]["describe"]["weight_repack"]
    assert not rows["plain"]["describe"]["tiled_matmul"]
    for name in ("repack+rule", "repack+tiled+rule", "repack", "repack+tiled"):
        assert rows[name]["describe"]["weight_repack"], name  # Q4_K is repacked here
        # Gemma's Q6_K weights are not repacked on x86: the tiled matmul takes them when on.
        assert rows[name]["describe"]["tiled_matmul"] == ("tiled" in name), name
    # Bit-exact: the stored weights, and the repacked ones under the row rule with the tiled
    # matmul off or on; without the rule a 4-row pass differs from single steps.
    for name in ("plain", "repack+rule", "repack+tiled+rule"):
        assert rows[name]["bitwise"], name
    assert not rows["repack"]["bitwise"] and rows["repack"]["verify"]["4"]["gap"] > 0
    for row in rows.values():
        assert row["prompt_tok_s"] > 0 and row["decode_tok_s"] > 0
        assert set(row["verify"]) == {"1", "2", "3", "4", "5", "8", "9"}
        assert row["verify"]["1"]["bitwise"]  # one row is one row, in any configuration
    assert "repack+rule" in done.stdout  # the table
