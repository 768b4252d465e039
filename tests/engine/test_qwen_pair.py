"""The real pair: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) as the target, its family built by
`drafts build --family qwen2.5-coder` (the 0.5B sibling, prompt lookup, the datastore of its
own answers). Bounded for CI: a step of the 1.5B costs ~60 ms on 2 cores, so generations are
short and the sampling test draws fewer samples (its threshold is computed for that count; the
power of the harness is shown on the small families in test_sampling_distribution.py).

- greedy output with every draft of the family, the sibling at k 1-8 and `auto`, is plain
  decoding's, token for token;
- generation ends on every end-of-generation token of the vocabulary (`<|endoftext|>` in a
  completion, not only `<|im_end|>`);
- speculative sampling with the sibling draws from the target's distribution;
- with `exactness = "numeric"` (slow tier; the row rule off: verification passes take the
  repacked kernels' gemm), plain decoding is unchanged, greedy speculative output differs from
  it only at near-ties (each divergence's top-2 margin printed), and sampling keeps the
  distribution;
- a sibling of another tokenizer is refused with the reason; the default pool is the family.
"""

from __future__ import annotations

import numpy as np
import pytest
from launcher import QWEN_DRAFTS, QWEN_SIBLING, TARGET_FILE, require_qwen
from sampling_check import exact_joint, null_threshold, speculative_samples, tv

from memspec.config import Settings
from memspec.drafts.family import find_siblings, named_sibling
from memspec.engine.sampling import SamplingParams
from memspec.errors import DraftIncompatible
from memspec.package_index import QWEN_SIBLING_FILE
from memspec.paths import models_dir

MAX_TOKENS = 16
PROMPTS = [
    'def filter_by_substring(strings: list[str], substring: str) -> list[str]:\n    """Keep '
    'the strings that contain substring."""\n',
    "Write a Python function that reverses a string, with a docstring.",  # as a chat turn
]
ENDOFTEXT, IM_END = 151643, 151645
# A file the 1.5B finishes in a few tokens, then says <|endoftext|> (not <|im_end|>).
ENDS_SOON = (
    'def add(a, b):\n    return a + b\n\n\nif __name__ == "__main__":\n    print(add(1, 2))\n'
)
N_SAMPLES = 300  # ~0.17 s a sample on a quiet 2-core box (the 1.5B and the 0.5B each prefill)


@pytest.fixture(scope="module")
def qwen():
    from memspec.runtime import Runtime

    rt = Runtime(Settings.load(target=str(require_qwen()), drafts=QWEN_DRAFTS, n_ctx=1024))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def prompts(qwen) -> list[list[int]]:
    return [
        qwen.requests.prompt_tokens(PROMPTS[0]),
        qwen.requests.prompt_tokens(messages=[{"role": "user", "content": PROMPTS[1]}]),
    ]


@pytest.fixture(scope="module")
def references(qwen, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    refs = [qwen.generate(p, params, draft="none").token_ids for p in prompts]
    assert all(refs), "a reference generation is empty"
    return refs


def test_the_family_is_the_sibling_and_the_targets_own_drafts(qwen):
    assert qwen.target.n_vocab == 151_936
    assert not qwen.draft_admin.incompatible, qwen.draft_admin.incompatible
    sibling = qwen.draft_admin.manifest(QWEN_SIBLING)
    assert sibling.kind == "model" and sibling.file == QWEN_SIBLING_FILE
    assert qwen.draft_admin.skipped["q2_k"].endswith("which is a model of its own at that size")
    assert set(QWEN_DRAFTS) <= set(qwen.drafts)


def test_every_end_of_generation_token_stops(qwen):
    """llama.cpp's EOG set, not only EOS/EOT: a completion ends at `<|endoftext|>`."""
    assert {ENDOFTEXT, IM_END} <= qwen.target.eos_token_ids
    prompt = qwen.requests.prompt_tokens(ENDS_SOON)
    gen = qwen.generate(prompt, SamplingParams(max_tokens=24), draft="none")
    assert gen.finish_reason == "stop", qwen.target.detokenize(gen.token_ids)
    assert not qwen.target.eos_token_ids & set(gen.token_ids)


@pytest.mark.parametrize("k", range(1, 9))
def test_sibling_greedy_identical_at_every_k(qwen, prompts, references, k):
    # One prompt per k, alternating (CI time): each k sees a code and a chat prompt nearby.
    prompt, ref = prompts[k % 2], references[k % 2]
    gen = qwen.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), draft=QWEN_SIBLING, k=k)
    assert gen.token_ids == ref, f"{QWEN_SIBLING} k={k} diverged"
    assert gen.proposed > 0


@pytest.mark.parametrize("draft", ["prompt-lookup", "datastore-ci", "auto"])
def test_greedy_identical_with_the_rest_of_the_family(qwen, prompts, references, draft):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    k = None if draft == "auto" else 4
    for prompt, ref in zip(prompts, references, strict=True):
        assert qwen.generate(prompt, params, draft=draft, k=k).token_ids == ref, (draft, k)


def assert_sibling_sampling_matches_the_target(rt) -> None:
    # A prompt whose first tokens are nearly certain keeps the exact joint small (one target
    # eval per first token in the nucleus).
    prompt = rt.requests.prompt_tokens("Monday, Tuesday, Wednesday,")
    exact = exact_joint(rt.target, prompt)
    counts = speculative_samples(rt, prompt, QWEN_SIBLING, N_SAMPLES)
    n = sum(counts.values())
    assert n == N_SAMPLES
    assert tv(counts, exact, n) < null_threshold(exact, n, np.random.default_rng(0))


def test_speculative_sampling_with_the_sibling_matches_the_target(qwen):
    assert_sibling_sampling_matches_the_target(qwen)


def test_a_sibling_of_another_tokenizer_is_refused_with_the_reason():
    target = require_qwen()
    with pytest.raises(DraftIncompatible, match="tokenizer of 49152 tokens.*151936"):
        named_sibling(target, models_dir() / TARGET_FILE)  # SmolLM2 beside Qwen
    found = find_siblings(target)
    assert [s.path.name for s in found] == [QWEN_SIBLING_FILE]
    assert found[0].id == QWEN_SIBLING


def test_the_default_pool_is_the_whole_family():
    from memspec.runtime import Runtime

    settings = Settings.load(target=str(require_qwen()), n_ctx=512)
    assert settings.drafts is None
    rt = Runtime(settings, calibrate_costs=False)
    try:
        assert QWEN_SIBLING in rt.preload_ids and "datastore-ci" in rt.preload_ids
        assert "prompt-lookup" in rt.preload_ids
        assert "datastore-live" not in rt.preload_ids  # its file (the full datastore) is not built
        assert QWEN_SIBLING in rt.drafts  # 2 GiB holds the 1.5B and the 0.5B
    finally:
        rt.close()


# exactness = "numeric": verification rows of 4+ go through the repacked gemm, which rounds
# otherwise than plain decoding's gemv (logits apart by up to ~0.7 on this target, measured
# by `memspec bench kernels`). A greedy divergence must sit where plain decoding's top two
# logits are that close. The slow tier's (scripts/test.sh --all): the pair's checks repeated in
# the other exactness mode (the default tier runs them in the bitwise one, above).
NEAR_TIE = 1.0
NUMERIC = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_numeric():
    from memspec.runtime import Runtime

    settings = Settings.load(
        target=str(require_qwen()), drafts=QWEN_DRAFTS, n_ctx=1024, exactness="numeric"
    )
    rt = Runtime(settings)
    assert rt.target.describe()["weight_repack"]
    assert not rt.target.describe()["batch_invariant"]  # what /admin/status reports
    yield rt
    rt.close()


@NUMERIC
def test_numeric_plain_decoding_is_the_bitwise_one(qwen_numeric, prompts, references):
    """One token a pass is gemv in either mode, and a new prompt's pass the same gemm groups."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for prompt, ref in zip(prompts, references, strict=True):
        assert qwen_numeric.generate(prompt, params, draft="none").token_ids == ref


@NUMERIC
@pytest.mark.parametrize("draft,k", [(QWEN_SIBLING, 4), (QWEN_SIBLING, 8), ("prompt-lookup", 4)])
def test_numeric_greedy_differs_only_at_near_ties(qwen, qwen_numeric, prompts, draft, k):
    for prompt in prompts:
        ref = qwen.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, logprobs=2), draft="none")
        got = qwen_numeric.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), draft=draft, k=k)
        diverged = next(
            (
                i
                for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids, strict=False))
                if a != b
            ),
            None,
        )
        if diverged is None:
            assert got.token_ids == ref.token_ids
            print(f"{draft} k={k}: identical to plain decoding")
            continue
        assert ref.logprobs is not None
        top = ref.logprobs[diverged].top
        margin = top[0][2] - top[1][2]  # logprobs differ as the logits do
        print(f"{draft} k={k}: diverged at token {diverged}, top-2 margin {margin:.4f}")
        assert got.token_ids[diverged] in (top[0][0], top[1][0])
        assert margin <= NEAR_TIE, (draft, k, diverged, margin)


@NUMERIC
def test_numeric_speculative_sampling_matches_the_target(qwen_numeric):
    assert_sibling_sampling_matches_the_target(qwen_numeric)
