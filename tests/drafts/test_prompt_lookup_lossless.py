"""Copying a file on the real CI target (SmolLM2-135M Q4_1): prompt lookup drafts the long
match deep, by the rule in memspec.drafts.prompt_lookup, and greedy output stays the target's
own token for token. Bounded: one 300-token prompt, 64 tokens, three decodes."""

from __future__ import annotations

import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import speculative_generate
from memspec.paths import models_dir

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

TARGET = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; the result is sorted by start."""
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """The length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))


def gaps(intervals, lo, hi):
    """The parts of [lo, hi] that no interval covers."""
    out = []
    cursor = lo
    for start, end in merge_intervals(intervals):
        if start > cursor:
            out.append([cursor, min(start, hi)])
        cursor = max(cursor, end)
    if cursor < hi:
        out.append([cursor, hi])
    return out
'''
PROMPT = (
    "Rename the function `merge_intervals` to `merge_ranges` everywhere in this file and "
    f"return the whole file.\n\n```python\n{SOURCE}```"
)
MAX_TOKENS = 64
# A verify curve on which deep drafts pay when they are accepted (SmolLM2 on 2 cores).
COSTS = [0.030, 0.034, 0.034, 0.040, 0.045, 0.052, 0.058, 0.065, 0.072]


class Calibrated(CostModel):
    """The curve as given, not corrected by the rounds' timings: the k chosen then depends
    on the output alone, not on how busy the machine running the test is."""

    def observe(self, m) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    path = models_dir() / TARGET
    if not path.is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)
    be = load_backend(path, BackendOptions(n_ctx=1024, n_threads=1))
    yield be
    be.close()


def test_copying_a_file_drafts_the_long_match_deep_and_stays_lossless(target):
    prompt = target.tokenize(
        target.chat_prompt([{"role": "user", "content": PROMPT}]), special=True
    )
    params = SamplingParams(max_tokens=MAX_TOKENS)
    target.reset()
    ref = speculative_generate(target, prompt, params, FixedPolicy(None, 0)).token_ids
    assert len(ref) == MAX_TOKENS

    lookup = PromptLookupDraft(max_ngram=3, min_ngram=2)
    target.reset()
    fixed = speculative_generate(target, prompt, params, FixedPolicy(lookup, 8))
    assert fixed.token_ids == ref, "prompt lookup at k=8 diverged"

    keys: list[str] = []

    class Recorded(DecisionRulePolicy):
        def observe(self, key, proposed, accepted, seconds):
            keys.append(key)
            super().observe(key, proposed, accepted, seconds)

    rule = Recorded([lookup], Calibrated(COSTS), AcceptanceEstimator(0.5), k_max=8)
    target.reset()
    gen = speculative_generate(target, prompt, params, rule)
    assert gen.token_ids == ref, "prompt lookup under the rule diverged"
    # The answer copies the file: the rule drafted from long matches, deep.
    lengths = [int(k.rsplit("/n", 1)[1]) for k in keys if "/n" in k]
    print(f"match buckets drafted from: {sorted(set(lengths))}; k per round: {gen.k_per_round}")
    if gen.accepted < MAX_TOKENS // 3:
        pytest.fail(f"the answer did not copy the file ({gen.accepted} accepted): {ref[:32]}")
    assert max(lengths) >= 16 and max(gen.k_per_round) == 8
