"""Speculative sampling draws from exactly the target's distribution (first two tokens).

The exact joint distribution of the first two tokens is computed from the target's own
logits; the empirical distribution of speculative samples must lie within the 99.9th
percentile of total-variation distances that sampling from the exact distribution produces.
The same harness with an argmax-only acceptance rule (a wrong implementation, injected on
purpose) must fail it: the test has power. Both model families run it: SmolLM2 (vocabulary
49,152) and, in the slow tier, Gemma 3 270M (262,144) with its own derived drafts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from sampling_check import (
    N_POWER,
    N_SAMPLES,
    exact_joint,
    null_threshold,
    speculative_samples,
    tv,
)

import memspec.engine.sampling as sampling
import memspec.engine.speculative as spec
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams

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
            runtime.requests.prompt_tokens(text)
            if text
            else runtime.requests.prompt_tokens(messages=CHAT_PROMPT)
        )
        exact = exact_joint(runtime.target, prompt)
        threshold = null_threshold(exact, N_SAMPLES, np.random.default_rng(0))
        _setups[family] = (prompt, exact, threshold)
    return (runtime, *_setups[family])


# The default tier samples once per draft kind on SmolLM2 (the model kind, prompt lookup); the
# same checks on Gemma 3 (its 262k vocabulary) are the slow tier's (scripts/test.sh --all).
GEMMA_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "family,draft_id",
    [
        ("smollm2", "q2_k"),
        ("smollm2", "prompt-lookup"),
        pytest.param("gemma3", "q2_k", marks=GEMMA_SLOW),
    ],
)
def test_speculative_sampling_matches_target(request, family, draft_id):
    runtime, prompt, exact, threshold = family_setup(request, family)
    counts = speculative_samples(runtime, prompt, draft_id)
    n = sum(counts.values())
    assert n == N_SAMPLES
    assert tv(counts, exact, n) < threshold


@pytest.mark.parametrize("family", ["smollm2", pytest.param("gemma3", marks=GEMMA_SLOW)])
def test_argmax_only_acceptance_is_detected(request, monkeypatch, family):
    runtime, prompt, exact, _ = family_setup(request, family)

    def argmax_accept(token, p, q, rng):  # wrong on purpose: accept iff it is p's argmax
        return int(np.argmax(p)) == token

    monkeypatch.setattr(sampling, "accept_draft_token", argmax_accept)  # the round's rule
    counts = speculative_samples(runtime, prompt, "q2_k", N_POWER)
    n = sum(counts.values())
    assert tv(counts, exact, n) > null_threshold(exact, n, np.random.default_rng(0))


# top_k and penalties on a prompt that repeats itself (the penalties move most of the mass):
# the first two tokens are drafted and verified in one round, so the second one's penalties
# count the first while it is still pending (tests/engine/test_sampling_fields.py checks that
# part exactly, with greedy).
PROCESSED = SamplingParams(
    temperature=1.0, top_k=3, repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=1.5
)
REPEATING = "ha ha ha ha ha ha ha"
# Fewer samples than the tests above (each costs a target pass or two): the threshold is the
# null's for this many, and the mutant below is far off (the penalties move most of the mass).
N_PROCESSED, N_PROCESSED_POWER = 600, 200
_processed: dict[str, tuple] = {}


def processed_setup(runtime):
    if "smollm2" not in _processed:
        prompt = runtime.requests.prompt_tokens(REPEATING)
        exact = exact_joint(runtime.target, prompt, PROCESSED)
        threshold = null_threshold(exact, N_PROCESSED, np.random.default_rng(0))
        _processed["smollm2"] = (prompt, exact, threshold)
    return _processed["smollm2"]


def processed_samples(runtime, prompt, n: int) -> Counter:
    draft = runtime.drafts["q2_k"]
    counts: Counter = Counter()
    for seed in range(n):
        params = replace(PROCESSED, max_tokens=2, seed=seed)
        gen = spec.speculative_generate(runtime.target, prompt, params, FixedPolicy(draft, 2))
        if len(gen.token_ids) == 2:
            counts[tuple(gen.token_ids)] += 1
    return counts


def test_top_k_and_penalties_sample_the_processed_target(runtime):
    prompt, exact, threshold = processed_setup(runtime)
    assert len({t1 for t1, _ in exact}) == 3  # top_k cut the first token to 3
    counts = processed_samples(runtime, prompt, N_PROCESSED)
    n = sum(counts.values())
    assert n == N_PROCESSED
    assert tv(counts, exact, n) < threshold


def test_a_rule_ignoring_top_k_and_penalties_is_detected(runtime, monkeypatch):
    prompt, exact, _ = processed_setup(runtime)
    plain = sampling.probs_from_logits
    # Wrong on purpose: the raw tempered distribution (no penalties, no top_k).
    monkeypatch.setattr(sampling, "adjust_logits", lambda z, params, history, pending: z)
    monkeypatch.setattr(sampling, "probs_from_logits", lambda z, p: plain(z, replace(p, top_k=0)))
    counts = processed_samples(runtime, prompt, N_PROCESSED_POWER)
    n = sum(counts.values())
    assert tv(counts, exact, n) > null_threshold(exact, n, np.random.default_rng(0))
