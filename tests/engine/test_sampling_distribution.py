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

import memspec.engine.speculative as spec
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams, probs_from_logits

N_SAMPLES = 1200
PARAMS = dict(temperature=1.0, top_p=0.9)


def exact_joint(runtime, prompt: list[int]) -> dict[tuple[int, int], float]:
    target = runtime.target
    params = SamplingParams(**PARAMS)
    target.reset()
    target.eval(prompt[:-1], all_logits=False)
    p1 = probs_from_logits(target.eval([prompt[-1]])[-1], params)
    joint = {}
    for t1 in np.flatnonzero(p1):
        target.truncate(len(prompt))
        p2 = probs_from_logits(target.eval([int(t1)])[-1], params)
        for t2 in np.flatnonzero(p2):
            joint[(int(t1), int(t2))] = float(p1[t1] * p2[t2])
    target.reset()
    return joint


def tv(counts: Counter, exact: dict, n: int) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def null_threshold(exact: dict, n: int, rng: np.random.Generator) -> float:
    keys = list(exact)
    p = np.array([exact[k] for k in keys])
    p /= p.sum()
    dists = []
    for _ in range(400):
        draws = rng.multinomial(n, p)
        dists.append(0.5 * np.abs(draws / n - p).sum())
    return float(np.quantile(dists, 0.999))


def speculative_samples(runtime, prompt, draft_id: str) -> Counter:
    draft = runtime.drafts[draft_id]
    counts: Counter = Counter()
    for seed in range(N_SAMPLES):
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
        exact = exact_joint(runtime, prompt)
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
    runtime, prompt, exact, threshold = family_setup(request, family)

    def argmax_accept(token, p, q, rng):  # wrong on purpose: accept iff it is p's argmax
        return int(np.argmax(p)) == token

    monkeypatch.setattr(spec, "accept_draft_token", argmax_accept)
    counts = speculative_samples(runtime, prompt, "q2_k")
    assert tv(counts, exact, sum(counts.values())) > threshold
