"""The harness of the sampling-distribution tests: the exact joint of a prompt's first two
tokens under the target, and the total-variation distance that sampling from it would reach."""

from __future__ import annotations

from collections import Counter

import numpy as np

from memspec.backends.base import Backend
from memspec.engine.sampling import SamplingParams, TokenHistory, target_probs

N_SAMPLES = 1200
# The power checks: a wrong acceptance rule is far off the exact joint, so this many samples
# (with the threshold for this many) show it.
N_POWER = 400
PARAMS = dict(temperature=1.0, top_p=0.9)


def exact_joint(
    target: Backend, prompt: list[int], params: SamplingParams | None = None
) -> dict[tuple[int, int], float]:
    """Plain decoding's joint of the first two tokens, one position at a time: the second
    token's penalties count the first (TokenHistory, as plain decoding pushes it)."""
    params = params or SamplingParams(**PARAMS)
    history = TokenHistory(params, prompt)
    target.reset()
    target.eval(prompt[:-1], all_logits=False)
    p1 = target_probs(target.eval([prompt[-1]])[-1], params, history)
    joint = {}
    for t1 in np.flatnonzero(p1):
        target.truncate(len(prompt))
        p2 = target_probs(target.eval([int(t1)])[-1], params, history, [int(t1)])
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


def speculative_samples(runtime, prompt: list[int], draft_id: str, n: int = N_SAMPLES) -> Counter:
    """The first two tokens of `n` speculative samples (seeds 0..n-1) with `draft_id` at k 2."""
    import memspec.engine.speculative as spec  # looked up per call: tests patch its rules
    from memspec.engine.policy import FixedPolicy

    draft = runtime.drafts[draft_id]
    counts: Counter = Counter()
    for seed in range(n):
        params = SamplingParams(max_tokens=2, seed=seed, **PARAMS)
        gen = spec.speculative_generate(runtime.target, prompt, params, FixedPolicy(draft, 2))
        if len(gen.token_ids) == 2:
            counts[tuple(gen.token_ids)] += 1
    return counts
