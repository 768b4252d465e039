"""The recipes' corpus: the target's answers from llama.cpp and from torch (`teacher`)."""

from __future__ import annotations

import pytest
from launcher import TARGET_FILE, require_testbed

from memspec.paths import models_dir
from memspec.recipes import corpus


@pytest.fixture(scope="module")
def target_path():
    require_testbed()
    return models_dir() / TARGET_FILE


@pytest.mark.slow
def test_torch_answers_are_the_targets(target_path):
    """Left-padded batches of different prompt lengths, bfloat16 matmuls: the answers must
    still be the target's own (llama.cpp's F32 greedy answers). A wrong pad side, mask or
    chat template gives other text from the first token; bfloat16 may flip a near-tie late,
    so the opening tokens are compared."""
    pytest.importorskip("transformers")
    rows = corpus.select_seeds(None, 1, seed=0)[:4]  # four domains, prompts of mixed length
    llama = corpus.BatchedGreedy(target_path, batch=4, n_ctx_per_seq=384, n_threads=2)
    try:
        want = {r["prompt"]: out for r, out in llama.run(rows, 12)}
        chats = [llama.chat_tokens(r["prompt"]) for r in rows]
    finally:
        llama.close()
    gen = corpus.TorchGreedy(target_path, batch=4, n_ctx_per_seq=384, n_threads=2)
    try:
        assert [gen.chat_tokens(r["prompt"]) for r in rows] == chats
        assert len({len(c) for c in chats}) > 1  # the batch really is padded
        got = {r["prompt"]: out for r, out in gen.run(rows, 12)}
    finally:
        gen.close()
    assert got.keys() == want.keys()
    same = [got[p][:6] == want[p][:6] for p in want]
    assert sum(same) >= 3, (got, want)
    assert all(0 < len(out) <= 12 for out in got.values())


@pytest.mark.slow
def test_torch_answers_are_cached_apart(target_path):
    """bfloat16 answers must never be read back as llama.cpp's exact ones (or the reverse)."""
    exact = corpus.generated_corpus_path(target_path)
    torch_text = corpus.generated_corpus_path(target_path, "torch")
    assert exact != torch_text and exact.parent == torch_text.parent


def test_teacher_field_keeps_existing_recipe_keys(target_path, monkeypatch):
    """Drafts built before `teacher` existed are not rebuilt for it; a torch teacher is a
    different build."""
    import hashlib
    import json

    from memspec.drafts.manifest import load_manifests
    from memspec.recipes import build

    m = load_manifests()["distill-ci"]
    assert m.build is not None and m.build.teacher == "llama_cpp"
    key = build._recipe_key(m, target_path, "sha")
    monkeypatch.setattr(build, "ADDED_FIELD_DEFAULTS", {})  # as if the field were old
    assert build._recipe_key(m, target_path, "sha") != key
    monkeypatch.undo()
    recipe = m.build.model_dump()
    del recipe["teacher"]  # the recipe as it was dumped before the field was added
    parts = [recipe, "sha", build.sha256_file(corpus.SEEDS_FILE)]
    assert hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest() == key
    torch_m = m.model_copy(update={"build": m.build.model_copy(update={"teacher": "torch"})})
    assert build._recipe_key(torch_m, target_path, "sha") != key


def test_seed_selection_independent_of_other_domains():
    from memspec.recipes.corpus import select_seeds

    everything = {r["prompt"] for r in select_seeds(None, 10, 0)}
    some = select_seeds(["stem", "writing"], 10, 0)
    assert len(some) == 20 and all(r["prompt"] in everything for r in some)
    assert select_seeds(["coding"], 10, 1) != select_seeds(["coding"], 10, 0)  # the seed matters


@pytest.mark.models
def test_seed_prompts_are_not_mt_bench():
    import re

    from memspec.recipes.corpus import load_seeds
    from memspec_lab.testbed import load_mtbench

    def grams(text: str, n: int = 6) -> set[tuple[str, ...]]:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    test_set: set[tuple[str, ...]] = set()
    for q in load_mtbench():
        for turn in q["turns"]:
            test_set |= grams(turn)
    seeds = load_seeds()
    assert len(seeds) >= 1500 and {r["domain"] for r in seeds} == {
        "coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing"
    }  # fmt: skip
    leaks = [r["prompt"] for r in seeds if grams(r["prompt"]) & test_set]
    assert not leaks, leaks[:3]
