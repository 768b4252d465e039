"""A target's own predictor comes before the shipped ones; training writes it where it is found."""

import json
import subprocess
import sys
from pathlib import Path

from memspec.paths import DEFAULT_PREDICTOR
from memspec.predictor.artifacts import SHIPPED_DIR, predictor_path, trained_path
from memspec_lab.sim.traces import TRACE_VERSION

REPO = Path(__file__).resolve().parents[2]


def test_the_order_configured_then_trained_then_shipped_then_the_testbed(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMSPEC_DATA_DIR", str(tmp_path))
    target = Path("some-target-q4_k_m.gguf")
    assert predictor_path(target) == DEFAULT_PREDICTOR
    trained = trained_path(target)
    assert trained == tmp_path / "predictors" / "some-target-q4_k_m.json"
    trained.parent.mkdir(parents=True)
    trained.write_text("{}")
    assert predictor_path(target) == trained
    mine = tmp_path / "mine.json"
    assert predictor_path(target, mine) == mine


def test_a_shipped_predictor_is_found_by_the_target_slug():
    for artifact in SHIPPED_DIR.glob("*.json"):
        if artifact == DEFAULT_PREDICTOR:
            continue
        target = json.loads(artifact.read_text())["meta"]["target"]
        assert predictor_path(Path(target)) in (artifact, trained_path(Path(target)))


def _trace(path: Path, target: str) -> None:
    header = {
        "type": "header",
        "version": TRACE_VERSION,
        "settings": {"target": target},
        "drafts": {},
        "costs": {},
    }
    path.write_text(json.dumps(header) + "\n")


def test_training_on_another_targets_traces_is_refused(tmp_path):
    trace = tmp_path / "t.jsonl"
    _trace(trace, "data/models/smollm2-135m-f32.gguf")
    p = subprocess.run(
        [sys.executable, "-m", "memspec.cli", "predictor", "train", "--traces", str(trace)]
        + ["--target", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert p.returncode == 2
    assert "collected on smollm2-135m-f32.gguf, not on qwen2.5" in p.stderr
