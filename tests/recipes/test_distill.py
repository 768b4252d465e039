"""Recipe "distill": export layout, resume and determinism, and the CI-size draft end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.drafts.manifest import BuildRecipe, load_manifests
from memspec.drafts.model import ModelDraft
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import speculative_generate
from memspec.files import sha256_file
from memspec.paths import models_dir
from memspec.recipes import distill
from memspec.recipes.build import build_all

pytest.importorskip("torch")

TARGET = "smollm2-135m-f32.gguf"


@pytest.fixture(scope="module")
def target_path():
    p = models_dir() / TARGET
    if not p.is_file():
        pytest.fail(f"{p} missing: run scripts/setup.sh", pytrace=False)
    return p


@pytest.mark.models
def test_export_reproduces_the_target_gguf_bit_for_bit(target_path):
    """transformers un-permutes Q/K on load; the export must put llama.cpp's order back."""
    import gguf

    model = distill.load_student(target_path, list(range(30)))
    exported = distill.gguf_tensors(model)
    reader = gguf.GGUFReader(str(target_path))
    names = {t.name for t in reader.tensors}
    assert set(exported) == names
    for t in reader.tensors:
        assert exported[t.name].shape == t.data.shape, t.name
        assert exported[t.name].tobytes() == t.data.tobytes(), t.name


def _tiny_recipe(**kw) -> BuildRecipe:
    base = dict(
        recipe="distill",
        source=TARGET,
        keep_layers=[0, 29],
        seeds_per_domain=0,
        gen_tokens=0,
        package_chars=6000,
        steps=4,
        batch_size=2,
        seq_len=48,
        ckpt_every=2,
        eval_seqs=2,
        ftype="F32",
    )
    return BuildRecipe(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.models
def test_interrupted_build_resumes_and_matches_an_uninterrupted_one(
    target_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("MEMSPEC_DATA_DIR", str(tmp_path / "data"))
    recipe = _tiny_recipe()
    whole = tmp_path / "whole.gguf"
    report = distill.build_distilled_file(recipe, target_path, whole, "a" * 64, progress=False)
    assert report["steps"] == 4 and report["kl_last"] < report["kl_first"]

    # Same recipe under another key (its own checkpoint dir); a fault injected at step 4.
    real = distill._teacher_logprobs
    calls = {"n": 0, "fail_at": 4}

    def counted(*args):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected fault")
        return real(*args)

    monkeypatch.setattr(distill, "_teacher_logprobs", counted)
    resumed = tmp_path / "resumed.gguf"
    with pytest.raises(RuntimeError, match="injected"):
        distill.build_distilled_file(recipe, target_path, resumed, "b" * 64, progress=False)
    ckpt = tmp_path / "data" / "cache" / "distill" / ("b" * 16) / "checkpoint.pt"
    assert ckpt.is_file() and not resumed.exists()

    calls.update(n=0, fail_at=-1)  # a rerun continues from the step-2 checkpoint: 2 steps left
    distill.build_distilled_file(recipe, target_path, resumed, "b" * 64, progress=False)
    assert calls["n"] == 2
    # Deterministic: the resumed run wrote the same bytes as the uninterrupted one.
    assert sha256_file(resumed) == sha256_file(whole)
    assert not ckpt.exists()


@pytest.mark.models
def test_distill_needs_a_corpus(target_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMSPEC_DATA_DIR", str(tmp_path / "data"))
    recipe = _tiny_recipe(package_chars=0)
    with pytest.raises(ValueError, match="empty corpus"):
        distill.build_distilled_file(recipe, target_path, tmp_path / "x.gguf", "c" * 64)


@pytest.fixture(scope="module")
def distill_ci(target_path):
    """The CI-size distilled draft, built by the real command path (cached once built)."""
    [(draft_id, path, _)] = build_all(only=["distill-ci"])
    assert draft_id == "distill-ci"
    return path


@pytest.mark.slow
@pytest.mark.models
def test_ci_draft_trained_and_reports(distill_ci):
    info = json.loads(distill_ci.with_name(distill_ci.name + ".build.json").read_text())
    report = info["report"]
    assert report["kl_last"] < report["kl_first"] / 2
    assert 0.0 <= report["heldout_top1_agreement"]["all"] <= 1.0
    # Two blocks of thirty and a Q8_0 export: far below the Q4_0 self-draft.
    assert (
        distill_ci.stat().st_size < 0.5 * (models_dir() / "smollm2-135m-q4_0.gguf").stat().st_size
    )


def built_distilled() -> list[str]:
    """distill-ci (built by its fixture) and every other distilled draft built here."""
    ids = {"distill-ci"}
    for m in load_manifests().values():
        if m.build is not None and m.build.recipe == "distill":
            if m.model_path(models_dir()).is_file():
                ids.add(m.id)
    return sorted(ids)


# Slow tier: distill-ci is trained here (minutes). The model draft kind's greedy lossless check
# stays in the default tier (tests/engine/test_speculative.py, the Q2_K self-draft).
@pytest.mark.slow
@pytest.mark.parametrize("draft_id", built_distilled())
@pytest.mark.models
def test_every_built_distilled_draft_is_lossless(draft_id, target_path, request):
    m = load_manifests()[draft_id]
    path = request.getfixturevalue("distill_ci") if draft_id == "distill-ci" else None
    path = path or m.model_path(models_dir())
    target = load_backend(target_path, BackendOptions(n_ctx=256, n_threads=1))
    draft = ModelDraft(draft_id, load_backend(path, BackendOptions(n_ctx=256, n_threads=1)))
    params = SamplingParams(max_tokens=24)
    try:
        assert draft.backend.n_layers == len(m.build.keep_layers)
        for text in ["Write a Python function that reverses a list.", "Name three rivers."]:
            prompt = target.tokenize(
                target.chat_prompt([{"role": "user", "content": text}]), special=True
            )
            target.reset()
            ref = speculative_generate(target, prompt, params, FixedPolicy(None, 0)).token_ids
            assert ref
            for k in (1, 3, 8):
                target.reset()
                gen = speculative_generate(target, prompt, params, FixedPolicy(draft, k))
                assert gen.token_ids == ref, f"k={k} diverged"
                assert gen.proposed > 0
    finally:
        draft.close()
        target.close()


def test_gguf_tensors_permutes_q_and_k_only():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    p = distill._rope_permute(w, 2)
    # Per head of 4 rows: rows (0, 2, 1, 3) — interleaved halves, as llama.cpp's rope expects.
    assert p[:4].tolist() == w[[0, 2, 1, 3]].tolist()
    assert p[4:].tolist() == w[[4, 6, 5, 7]].tolist()
