"""The second model family: Gemma 3 270M (vocabulary 262,144) as the target, with the pool
`drafts build --family gemma3` derived for it (memspec.drafts.family). Greedy output with every
derived draft and any k is plain decoding's, token for token; the sampling distribution test
runs on it in test_sampling_distribution.py (the slow tier's)."""

from __future__ import annotations

import pytest
from launcher import GEMMA_DRAFTS

from memspec.drafts.family import family_dir
from memspec.engine.sampling import SamplingParams
from memspec.errors import UnknownDraft

MAX_TOKENS = 32
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are red, yellow and blue. The three primary colors",
]


@pytest.fixture(scope="module")
def prompts(gemma_runtime) -> list[list[int]]:
    chat = [{"role": "user", "content": "List three benefits of regular exercise."}]
    return [gemma_runtime.requests.prompt_tokens(p) for p in PROMPTS] + [
        gemma_runtime.requests.prompt_tokens(messages=chat)
    ]


@pytest.fixture(scope="module")
def references(gemma_runtime, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return [gemma_runtime.generate(p, params, draft="none").token_ids for p in prompts]


def test_the_pool_is_the_targets_own(gemma_runtime):
    rt = gemma_runtime
    assert rt.target.n_vocab == 262_144
    for draft_id in GEMMA_DRAFTS:
        m = rt.draft_admin.manifest(draft_id)
        assert m.source_path is not None and m.source_path.parent == family_dir(rt.target.path)
        if m.file:  # stored per target: never the testbed's file
            assert m.file.startswith("gemma-3-270m-q4_k_m-")
    assert not rt.draft_admin.incompatible, rt.draft_admin.incompatible
    # A recipe the family skipped is refused with the reason, not as a typo.
    with pytest.raises(UnknownDraft, match="not built for this target.*bits/weight"):
        rt.draft_admin.manifest("q4_0")


@pytest.mark.parametrize("draft", GEMMA_DRAFTS)
def test_greedy_identical_for_every_derived_draft_and_k(gemma_runtime, prompts, references, draft):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert all(references), "a reference generation is empty"
    for prompt, ref in zip(prompts, references, strict=True):
        for k in range(1, 9):
            gen = gemma_runtime.generate(prompt, params, draft=draft, k=k)
            assert gen.token_ids == ref, f"{draft} k={k} diverged"


def test_greedy_identical_under_auto(gemma_runtime, prompts, references):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for prompt, ref in zip(prompts, references, strict=True):
        assert gemma_runtime.generate(prompt, params, draft="auto").token_ids == ref
