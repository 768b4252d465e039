"""Grammar-constrained decoding stays lossless under speculation (memspec/engine/grammar.py).

Greedy output under a grammar equals plain decoding under the same grammar whatever the draft
(the grammar masks each verified row and advances only on kept tokens); sampling under a
grammar draws from exactly the masked target distribution (the exact joint of the first two
tokens, as tests/engine/test_sampling_distribution.py checks it without one).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from sampling_check import PARAMS, null_threshold, tv

from memspec.engine.grammar import Grammar
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams, probs_from_logits
from memspec.engine.speculative import speculative_generate
from memspec.errors import InvalidRequest
from memspec.server.structured import json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": {"type": "string"}},
        "place": {"type": "string"},
    },
    "required": ["people", "place"],
    "additionalProperties": False,
}
EXTRACT = (
    "Extract the people and the place as JSON from this sentence: Alice met Bob and Carol at "
    "the station, then Alice and Carol took the train."
)
# Every draft kind of the testbed pool: lookup, quantized self-drafts, a retrieval datastore.
DRAFTS = ["prompt-lookup", "q8_0", "q4_0", "q2_k", "datastore-ci"]


@pytest.fixture(scope="module")
def schema_grammar(runtime) -> Grammar:
    return Grammar(json_schema_grammar(SCHEMA), runtime.target.path)


def test_bad_grammars_are_refused_with_their_param(runtime):
    with pytest.raises(InvalidRequest) as e:
        Grammar("root ::= undefined-rule", runtime.target.path)
    assert e.value.param == "grammar" and "undefined-rule" in e.value.message


def test_grammar_greedy_identical_for_every_draft_kind(runtime, schema_grammar):
    prompt = runtime.requests.prompt_tokens(messages=[{"role": "user", "content": EXTRACT}])
    params = SamplingParams(max_tokens=48, grammar=schema_grammar)
    ref = runtime.generate(prompt, params, draft="none")
    assert ref.finish_reason == "stop", ref.text
    value = json.loads(ref.text)
    assert set(value) == {"people", "place"} and isinstance(value["people"], list)
    accepted = 0
    for draft in DRAFTS:
        for k in (2, 5):
            gen = runtime.generate(prompt, params, draft=draft, k=k)
            assert gen.token_ids == ref.token_ids, f"{draft} k={k} diverged under the grammar"
            accepted += gen.accepted
    assert accepted > 0, "no draft token was ever accepted: the test checks nothing"


def test_grammar_applies_to_plain_decoding(runtime):
    prompt = runtime.requests.prompt_tokens(messages=[{"role": "user", "content": "Is water wet?"}])
    grammar = Grammar('root ::= "yes" | "no"', runtime.target.path)
    for draft in ("none", "q4_0"):
        gen = runtime.generate(prompt, SamplingParams(max_tokens=16, grammar=grammar), draft=draft)
        assert gen.text in ("yes", "no") and gen.finish_reason == "stop"


def test_greedy_is_the_masked_argmax_without_a_full_pass(runtime, schema_grammar):
    """greedy() checks a row's most likely tokens one by one before masking the whole
    vocabulary: its choice must be np.argmax of the masked row in every state, ties
    included, and a row whose best allowed token ranks near the top must not be masked."""
    rng = np.random.default_rng(0)
    state = schema_grammar.start()
    full_passes = 0
    mask = state.mask

    def counted(row: np.ndarray) -> np.ndarray:
        nonlocal full_passes
        full_passes += 1
        return mask(row)

    state.mask = counted  # type: ignore[method-assign] - counts the passes, changes nothing
    text = runtime.target.tokenize('{"people": ["Al", "Bo"], "place": "X"}', add_bos=False)
    scanned = 0
    for token in text:
        for _ in range(20):
            row = rng.standard_normal(runtime.target.n_vocab).astype(np.float32)
            row[rng.integers(len(row), size=8)] = row.max()  # ties at the top
            allowed = np.flatnonzero(np.isfinite(mask(row)))
            if rng.random() < 0.5:  # its best allowed token among the row's top 8
                row[allowed[rng.integers(len(allowed))]] = np.sort(row)[-rng.integers(1, 8)]
            expect = int(np.argmax(mask(row)))
            before = full_passes
            assert state.greedy(row) == expect
            scanned += full_passes == before
        state.accept(token)
    state.close()
    assert scanned > 0, "every choice took a full pass: the scan never ran"
    assert full_passes > 0, "no row fell through to the full pass: that branch is untested"


# A grammar that keeps a few of the target's likely first tokens after "Name a fruit." and
# removes the rest (its usual "Sure"/"A" openings among them): the masked joint is far
# from the unmasked one, so a rule that skipped the mask anywhere would show.
# Half the unconstrained test's samples (the threshold is for this many): each runs the q2_k
# draft and the target, and the suite's time is bounded.
N_SAMPLES = 600
FRUITS = 'root ::= ("Apple" | "Banana" | "Cherry" | "Mango") ("." | "!" | " is" | " and" | ",")'


def masked_joint(target, prompt, grammar: Grammar) -> dict[tuple[int, int], float]:
    params = SamplingParams(**PARAMS)
    state = grammar.start()
    target.reset()
    target.eval(prompt[:-1], all_logits=False)
    p1 = probs_from_logits(state.mask(target.eval([prompt[-1]])[-1]), params)
    state.close()
    joint = {}
    for t1 in np.flatnonzero(p1):
        after = grammar.start()
        after.accept(int(t1))
        target.truncate(len(prompt))
        p2 = probs_from_logits(after.mask(target.eval([int(t1)])[-1]), params)
        after.close()
        for t2 in np.flatnonzero(p2):
            joint[(int(t1), int(t2))] = float(p1[t1] * p2[t2])
    target.reset()
    return joint


def test_grammar_sampling_matches_masked_target(runtime):
    prompt = runtime.requests.prompt_tokens(messages=[{"role": "user", "content": "Name a fruit."}])
    grammar = Grammar(FRUITS, runtime.target.path)
    exact = masked_joint(runtime.target, prompt, grammar)
    threshold = null_threshold(exact, N_SAMPLES, np.random.default_rng(0))
    draft = runtime.drafts["q2_k"]
    counts: Counter = Counter()
    accepted = 0
    for seed in range(N_SAMPLES):
        params = SamplingParams(max_tokens=2, seed=seed, grammar=grammar, **PARAMS)
        gen = speculative_generate(runtime.target, prompt, params, FixedPolicy(draft, 2))
        counts[tuple(gen.token_ids)] += 1
        accepted += gen.accepted
    assert set(counts) <= set(exact), "a sample the grammar does not allow"
    assert accepted > 0
    assert tv(counts, exact, N_SAMPLES) < threshold
