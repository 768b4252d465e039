"""Quantized KV caches (kv_type_k / kv_type_v, flash attention) on the real SmolLM2 target:
greedy output with every draft and under `auto` is plain decoding's with the same cache types,
and speculative sampling still draws from the target's distribution.

A divergence is allowed only at a near-tie (flash attention and a quantized cache may sum a
batch's rows in another order than single steps): the test prints the top-2 margin there.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPTS
from launcher import MODEL_DRAFTS, require_testbed
from sampling_check import exact_joint, null_threshold, speculative_samples, tv

from memspec.config import Settings
from memspec.engine.sampling import SamplingParams

MAX_TOKENS = 24
NEAR_TIE = 1e-3  # logit units: what a different summation order can move a logit by
CASES = {  # id -> the settings that make it
    "q8_0": {"kv_type_k": "q8_0", "kv_type_v": "q8_0"},
    "q4_0": {"kv_type_k": "q4_0", "kv_type_v": "q4_0"},
    "q8_0-k-f16-drafts": {"kv_type_k": "q8_0", "draft_kv_type_k": "f16"},
}


# Bounded for CI: every draft on q8_0; on the other caches the self-draft that shares the
# target's KV layout (q4_0) and the policy.
GREEDY_CASES = [("q8_0", d) for d in ("prompt-lookup", "q8_0", "q4_0", "q2_k", "auto")] + [
    (case, d) for case in ("q4_0", "q8_0-k-f16-drafts") for d in ("q4_0", "auto")
]


@pytest.fixture(scope="module", params=sorted(CASES))
def kv_runtime(request):
    from memspec.runtime import Runtime

    require_testbed()
    settings = Settings.load(
        drafts=["prompt-lookup", *MODEL_DRAFTS], n_ctx=1024, **CASES[request.param]
    )
    rt = Runtime(settings, calibrate_costs=False)  # costs alike: `auto` drafts every round
    yield rt
    rt.close()


def top2_margin(rt, tokens: list[int]) -> float:
    """The target's top-2 logit gap after `tokens`, decoded one token at a time."""
    rt.target.reset()
    logits = None
    for t in tokens:
        logits = rt.target.eval([t], all_logits=False)
    row = np.sort(np.asarray(logits, dtype=np.float64).reshape(-1))
    rt.target.reset()
    return float(row[-1] - row[-2])


def test_cache_types_reach_llama_cpp(kv_runtime):
    """The context stores what the settings say: its bytes per token are the types' (under
    f16's), and the budget charges the same."""
    rt = kv_runtime
    kv = rt.settings.kv_cache
    quantized_v = {kv.type_v, rt.settings.draft_kv_cache.type_v} != {"f16"}
    assert kv.flash_attn == quantized_v  # auto, on the CPU: on where a V cache is quantized
    t = rt.target
    per_token = kv.bytes_per_token(t.n_layers, t.n_kv_heads, t.head_dim_k, t.head_dim_v)
    f16 = t.n_layers * t.n_kv_heads * (t.head_dim_k + t.head_dim_v) * 2
    assert t.kv_bytes_per_token() == per_token < f16
    assert rt.target_footprint.kv == rt.slots * 1024 * per_token
    for d in rt.drafts.values():  # model drafts carry the draft cache types
        be = getattr(d, "backend", None)
        if be is not None:
            assert be.options.kv_cache == rt.settings.draft_kv_cache, d


@pytest.mark.parametrize(("kv_runtime", "draft"), GREEDY_CASES, indirect=["kv_runtime"])
def test_greedy_equals_plain_with_the_same_cache_types(kv_runtime, draft):
    rt = kv_runtime
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for text in PROMPTS[:2]:  # extraction (lookup pays) and code
        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": text}])
        ref = rt.generate(prompt, params, draft="none").token_ids
        assert ref
        for k in (2, 8) if draft != "auto" else (None,):
            got = rt.generate(prompt, params, draft=draft, k=k).token_ids
            if got == ref:
                continue
            at = next(i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b)
            margin = top2_margin(rt, prompt + ref[:at])
            print(f"{draft} k={k}: diverged at token {at}, top-2 margin {margin:.2e}")
            assert margin < NEAR_TIE, f"{draft} k={k} diverged at {at}, margin {margin:.3g}"


# One quantized case, in the slow tier: the default tier's sampling checks run on the f16 cache
# (tests/engine/test_sampling_distribution.py), and the greedy ones above on every cache here.
@pytest.mark.slow
@pytest.mark.parametrize("kv_runtime", ["q8_0"], indirect=True)
def test_sampling_matches_the_target_with_a_quantized_cache(kv_runtime):
    rt = kv_runtime
    prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": "Name a fruit."}])
    exact = exact_joint(rt.target, prompt)
    threshold = null_threshold(exact, 1200, np.random.default_rng(0))
    counts = speculative_samples(rt, prompt, "q2_k")
    assert tv(counts, exact, sum(counts.values())) < threshold
