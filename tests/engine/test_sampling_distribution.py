"""Speculative sampling draws from exactly the target's distribution (first two tokens).

The exact joint distribution of the first two tokens is computed from the target's own
logits; the empirical distribution of speculative samples must lie within the 99.9th
percentile of total-variation distances that sampling from the exact distribution produces.
The same harness with an argmax-only acceptance rule (a wrong implementation, injected on
purpose) must fail it: the test has power. Both model families run it: SmolLM2 (vocabulary
49,152) and Gemma 3 270M (262,144) with its own derived drafts.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from sampling_check import N_POWER, N_SAMPLES, PARAMS, exact_joint, null_threshold, tv

import memspec.engine.speculative as spec
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams


def speculative_samples(runtime, prompt, draft_id: str, n: int = N_SAMPLES) -> Counter:
    draft = runtime.drafts[draft_id]
    counts: Counter = Counter()
    for seed in range(n):
        params = SamplingParams(max_tokens=2, seed=seed, **PARAMS)
        gen = spec.speculative_generate(runtime.target, prompt, params, FixedPolicy(draft, 2))
        if len(gen.token_ids) == 2:
            counts[tuple(gen.token_ids)] += 1
    return counts


RUNTIME_OF = {"smollm2": "runtime", "gemma3": "gemma_runtime"}  # conftest fixtures
# A prompt whose first token's top-p nucleus is small: the exact joint takes one target eval per
# first token (Gemma's nucleus after a chat turn holds ~7,000 tokens; after this text, 3).
CHAT_PROMPT = [{"role": "user", "content": "Name a fruit."}]
TEXT_PROMPT = {"gemma3": "Monday, Tuesday,"}
_setups: dict[str, tuple] = {}


def family_setup(request, family: str):
    """(runtime, prompt, exact joint, threshold), computed once per family."""
    runtime = request.getfixturevalue(RUNTIME_OF[family])
    if family not in _setups:
        text = TEXT_PROMPT.get(family)
        prompt = (
            runtime.prompt_tokens(text) if text else runtime.prompt_tokens(messages=CHAT_PROMPT)
        )
        exact = exact_joint(runtime.target, prompt)
        threshold = null_threshold(exact, N_SAMPLES, np.random.default_rng(0))
        _setups[family] = (prompt, exact, threshold)
    return (runtime, *_setups[family])


@pytest.mark.parametrize(
    "family,draft_id", [("smollm2", "q2_k"), ("smollm2", "prompt-lookup"), ("gemma3", "q2_k")]
)
def test_speculative_sampling_matches_target(request, family, draft_id):
    runtime, prompt, exact, threshold = family_setup(request, family)
    counts = speculative_samples(runtime, prompt, draft_id)
    n = sum(counts.values())
    assert n == N_SAMPLES
    assert tv(counts, exact, n) < threshold


@pytest.mark.parametrize("family", ["smollm2", "gemma3"])
def test_argmax_only_acceptance_is_detected(request, monkeypatch, family):
    runtime, prompt, exact, _ = family_setup(request, family)

    def argmax_accept(token, p, q, rng):  # wrong on purpose: accept iff it is p's argmax
        return int(np.argmax(p)) == token

    monkeypatch.setattr(spec, "accept_draft_token", argmax_accept)
    counts = speculative_samples(runtime, prompt, "q2_k", N_POWER)
    n = sum(counts.values())
    assert tv(counts, exact, n) > null_threshold(exact, n, np.random.default_rng(0))
