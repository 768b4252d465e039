"""The edit workload of `bench engine`: real files from the venv, a fixed held-out split, the
context sized to the prompts (no model load: the target's tokenizer alone)."""

from __future__ import annotations

import re

import pytest

from memspec.cli import main
from memspec.paths import models_dir
from memspec_lab.bench.edit_workload import (
    EDIT_KINDS,
    TEMPLATE_TOKENS,
    WHOLE_FILE_MARGIN,
    count_tokens,
    edit_rows,
    fit_context,
    load_edit_workload,
    with_project_context,
)

HELD_OUT = {
    "llama_cpp/server/cli.py",
    "llama_cpp/server/errors.py",
    "tomli_w/_writer.py",
    "llama_cpp/server/model.py",
    "llama_cpp/server/app.py",
    "psutil/_common.py",
}


def test_the_split_is_fixed_and_documented():
    rows = edit_rows()
    assert {r["path"] for r in rows if r["split"] == "heldout"} == HELD_OUT
    assert not HELD_OUT & {r["path"] for r in rows if r["split"] == "tuning"}
    for split in ("heldout", "tuning"):  # every kind in each part, twice
        kinds = [r["kind"] for r in rows if r["split"] == split]
        assert sorted(kinds) == sorted(EDIT_KINDS * 2)


def test_every_file_is_in_this_venv_with_its_edit():
    for workload, heldout in (("edit", True), ("edit-tuning", False)):
        prompts, skipped = load_edit_workload(workload, per_category=10)
        assert not skipped and len(prompts) == 6
        for p in prompts:
            assert p.heldout is heldout and p.chat and p.category in EDIT_KINDS
            assert re.fullmatch(r"[0-9a-f]{64}", p.source["sha256"])
            assert p.source["version"] and p.text.endswith("in one ```python block.")
    row = next(r for r in edit_rows() if r["id"] == "edit-heldout-bug-tomli")
    (p,) = [p for p in load_edit_workload("edit", 10)[0] if p.id == row["id"]]
    assert row["inject"]["replace"] in p.text and row["inject"]["find"] not in p.text


@pytest.mark.models
def test_the_context_is_sized_to_the_longest_prompt_within_the_trained_context():
    target = models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    prompts, _ = load_edit_workload("edit", per_category=10)
    kept, skipped, n_ctx = fit_context(prompts, target, 512, 2048)
    assert len(kept) == 6 and not skipped and 2048 < n_ctx <= 8192 and n_ctx % 256 == 0
    assert max(p.source["tokens"] for p in kept) + 512 <= n_ctx
    kept, skipped, n_ctx = fit_context(prompts, target, 64, 1024, max_file_tokens=2000)
    assert all(p.source["tokens"] <= 2000 for p in kept) and len(kept) + len(skipped) == 6
    assert skipped and "max-file-tokens 2000" in skipped[0]["reason"] and n_ctx <= 2304


@pytest.mark.models
def test_a_long_context_precedes_the_file_with_the_projects_other_files():
    target = models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    prompts, _ = load_edit_workload("edit", per_category=1)
    kept, _, _ = fit_context(prompts, target, 64, 1024, max_file_tokens=2500)
    long = with_project_context(kept, target, 4096)
    counts = count_tokens(target, [p.text for p in long])
    for p, short, n in zip(long, kept, counts, strict=True):
        assert 0.97 * 4096 <= n <= 1.03 * 4096  # whole files, the last cut at a line
        assert p.text.endswith(short.text) and p.source["path"] not in p.source["context_files"]
        assert set(p.source["context_files"]) <= HELD_OUT and p.source["file_tokens"] < 2600
    (already,) = with_project_context(kept[:1], target, 100)  # a file longer than asked: as is
    assert already.text == kept[0].text


@pytest.mark.models
def test_whole_file_answers_get_room_for_their_file():
    target = models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    prompts, _ = load_edit_workload("edit", per_category=1)
    kept, skipped, n_ctx = fit_context(prompts, target, "file", 1024, max_file_tokens=2500)
    assert kept and len(kept) + len(skipped) == 3
    for p in kept:
        assert p.answer_tokens == p.source["tokens"] + WHOLE_FILE_MARGIN
        assert p.source["tokens"] + TEMPLATE_TOKENS + p.answer_tokens <= n_ctx <= 8192
    # At a long context the answer is still one file's, not the whole prompt's.
    long = with_project_context(kept, target, 4096)
    again, over, n_ctx = fit_context(long, target, "file", 1024)
    assert not over and n_ctx >= 4096
    for p, short in zip(again, kept, strict=True):
        assert p.answer_tokens == short.answer_tokens < p.source["tokens"]
    with pytest.raises(ValueError, match="'file'"):
        fit_context(prompts, target, "all", 1024)


def test_bench_engine_refuses_file_answers_where_there_is_no_file(tmp_path, capsys):
    out = tmp_path / "x.json"
    args = ["bench", "engine", "--workload", "heldout", "--max-tokens", "file", "--out", str(out)]
    assert main(args) == 2
    assert "edit workloads" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        main(["bench", "engine", "--max-tokens", "0", "--out", str(out)])
