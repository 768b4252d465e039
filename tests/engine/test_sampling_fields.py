"""Every sampling field at each verified position: greedy with logit_bias and penalties equals
plain decoding with them whatever the draft, inside a round the penalties count the drafted
tokens before a position, logprobs come from the verified rows, and the truncation samplers
keep what their definitions keep."""

from __future__ import annotations

import numpy as np
import pytest
from launcher import MODEL_DRAFTS

import memspec.engine.sampling as sampling
import memspec.engine.speculative as spec
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams, TokenHistory, adjust_logits, probs_from_logits

PROMPT = [{"role": "user", "content": "Write a list of fruits, and repeat apple often."}]
# Strong enough that every draft's proposals are often rejected by them.
PROCESSED = dict(
    repeat_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.5, logit_bias={28: -5.0}
)


def generate(runtime, prompt, draft: str | None, **fields):
    params = SamplingParams(**({"max_tokens": 24, "temperature": 0.0} | fields))
    policy = FixedPolicy(runtime.drafts[draft] if draft else None, 4 if draft else 0)
    return spec.speculative_generate(runtime.target, prompt, params, policy)


@pytest.fixture(scope="module")
def prompt(runtime):
    return runtime.requests.prompt_tokens(messages=PROMPT)


@pytest.fixture(scope="module")
def plain(runtime, prompt):
    """Plain decoding with the processing and logprobs."""
    return generate(runtime, prompt, None, logprobs=2, **PROCESSED)


def test_processing_changes_the_output(runtime, prompt, plain):
    assert generate(runtime, prompt, None).token_ids != plain.token_ids


@pytest.mark.parametrize("draft", ["prompt-lookup", *MODEL_DRAFTS])
def test_greedy_with_processing_equals_plain_decoding(runtime, prompt, plain, draft):
    gen = generate(runtime, prompt, draft, logprobs=2, **PROCESSED)
    assert gen.token_ids == plain.token_ids, draft
    # logprobs: the verified rows' values are plain decoding's (batch-invariant kernels).
    assert [e.token for e in gen.logprobs] == gen.token_ids
    for a, b in zip(gen.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
    assert gen.proposed > 0 or draft == "prompt-lookup"  # no n-gram of the prompt recurs


def test_penalties_count_the_rounds_earlier_tokens(runtime, monkeypatch):
    """On a prompt that repeats, a draft proposes repeats within a round. A rule that
    penalizes only committed tokens (not this round's drafted prefix) accepts some that plain
    decoding penalizes: the output differs, where the real rule's does not."""
    prompt = runtime.requests.prompt_tokens("1 1 1 1 1 1 1 1 1 1 1 1")
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, max_tokens=12)
    reference = generate(runtime, prompt, None, **fields).token_ids
    assert generate(runtime, prompt, "q8_0", **fields).token_ids == reference
    adjust = sampling.adjust_logits  # what the round's rule (sampling.accept_rows) calls
    monkeypatch.setattr(sampling, "adjust_logits", lambda z, p, h, pending: adjust(z, p, h))
    assert generate(runtime, prompt, "q8_0", **fields).token_ids != reference


def test_logprobs_are_the_raw_log_softmax(runtime, prompt, plain):
    e = plain.logprobs[0]
    assert e.piece == runtime.target.detokenize([e.token])
    assert e.logprob <= 0 and len(e.top) == 2
    assert e.top[0][2] >= e.top[1][2]


def test_history_window_and_counts():
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=2, frequency_penalty=1.0)
    h = TokenHistory(params, [5, 6, 7])
    h.push(1)
    z = adjust_logits(np.array([4.0, 4.0, -4.0, 0, 0, 4.0, 0, 4.0]), params, h, [2])
    # window: the last 2 of 7, 1, 2 -> {1, 2}: 4/2 and -4*2; counts: 1 and 2 once each.
    assert z.tolist() == [4.0, 1.0, -9.0, 0, 0, 4.0, 0, 4.0]


def test_logit_bias_and_the_filters():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0, 0, 0])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.5))
    assert p == pytest.approx([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0, 0])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, typical_p=0.5))
    assert np.count_nonzero(p) in (2, 3) and p.sum() == pytest.approx(1.0)
    z = adjust_logits(logits, SamplingParams(logit_bias={4: 100.0, 0: -np.inf}))
    assert int(np.argmax(z)) == 4 and z[0] == -np.inf
    ties = np.zeros(6)
    assert np.flatnonzero(probs_from_logits(ties, SamplingParams(1, 1.0, top_k=3))).tolist() == [
        0,
        1,
        2,
    ]
