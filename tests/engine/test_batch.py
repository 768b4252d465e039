"""Batched decoding on the real SmolLM2 target: sequences sharing one llama.cpp context, each
token for token what it gives alone (issue 12). Engine level: slots, decode_round, the
batch-level rule; the daemon's side is tests/server/test_batching.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from launcher import TARGET_FILE, require_testbed

from memspec.backends.base import BackendOptions, load_backend
from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.policy import DecisionRulePolicy, FixedPolicy
from memspec.engine.speculative import Sequence, decode_round, speculative_generate
from memspec.engine.types import Draft, SamplingParams
from memspec.paths import models_dir

SLOTS = 8
N_CTX = 384
TEXTS = [
    "Extract the names: Alice met Bob and Carol at the station; then Alice and Carol left.",
    "def fibonacci(n):\n    ",
    "Three benefits of regular exercise are",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "The capital of France is",
    "List the planets of the solar system in order: Mercury,",
    "Q: What is 17 times 23?\nA:",
]


@pytest.fixture(scope="module")
def target():
    require_testbed()
    be = load_backend(models_dir() / TARGET_FILE, BackendOptions(n_ctx=N_CTX, n_seq=SLOTS))
    yield be
    be.close()


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return [target.tokenize(t) for t in TEXTS]


def costs() -> CostModel:
    """Costs shaped like this box's (a batch of 8 ≈ 2.4 single steps): exactness must not
    depend on them, only how much is drafted."""
    return CostModel(
        verify_s=[0.044, 0.050, 0.057, 0.064, 0.072, 0.080, 0.088, 0.096, 0.104],
        batch_s={1: 0.044, 2: 0.057, 4: 0.072, 8: 0.104, 16: 0.165, 32: 0.285, 64: 0.536},
    )


def policy(i: int, lookup: Draft) -> FixedPolicy | DecisionRulePolicy:
    """A mix: plain decoding, fixed k, and the decision rule over prompt lookup."""
    if i % 3 == 0:
        return FixedPolicy(None, 0)
    if i % 3 == 1:
        return FixedPolicy(lookup, 2 + i % 5)
    return DecisionRulePolicy([lookup], costs(), AcceptanceEstimator(), k_max=8)


def alone(target, prompt: list[int], params: SamplingParams) -> list[int]:
    """The reference: plain decoding on slot 0, nothing else in the context's batches."""
    return speculative_generate(target, prompt, params, FixedPolicy(None, 0)).token_ids


def run_batch(target, seqs: list[Sequence], joining: list[Sequence] = (), join_at: int = 3):
    rounds = 0
    pending = list(joining)
    active = list(seqs)
    while any(not s.done for s in active) or pending:
        if rounds == join_at and pending:
            active += pending  # a request joining while the others decode
            pending = []
        decode_round(target, [s for s in active if not s.done], costs())
        rounds += 1
    return rounds


def test_eight_greedy_streams_identical_to_each_alone(target, prompts):
    lookup = PromptLookupDraft()
    lengths = [40, 24, 33, 48, 17, 29, 36, 44]
    refs = [
        alone(target, p, SamplingParams(max_tokens=n))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    for slot in target.slots:
        slot.reset()
    seqs = [
        Sequence(
            target.slots[i], prompts[i], SamplingParams(max_tokens=lengths[i]), policy(i, lookup)
        )
        for i in range(SLOTS)
    ]
    # Four start together; four join three rounds later, their prompts fed in chunks.
    run_batch(target, seqs[:4], seqs[4:])
    for i, s in enumerate(seqs):
        assert s.error is None, s.error
        assert s.result().token_ids == refs[i], f"slot {i} diverged under batching"
    assert sum(s.gen.proposed for s in seqs) > 0, "nothing was drafted in the batch"


def test_cancelled_and_context_full_sequences_leave_the_others_exact(target, prompts):
    lookup = PromptLookupDraft()
    refs = [alone(target, p, SamplingParams(max_tokens=40)) for p in prompts[:4]]
    for slot in target.slots:
        slot.reset()
    cancel = threading.Event()
    n_ctx = target.n_ctx  # what llama.cpp gives a slot (N_CTX rounded up to 256s)
    long_prompt = (prompts[3] * 60)[: n_ctx - 10]  # 10 tokens from the end of its context
    seqs = [
        Sequence(target.slots[i], prompts[i], SamplingParams(max_tokens=40), policy(i, lookup))
        for i in range(4)
    ]
    seqs[1].cancel = cancel
    full = Sequence(
        target.slots[5], long_prompt, SamplingParams(max_tokens=40), FixedPolicy(lookup, 4)
    )
    batch = [*seqs, full]
    rounds = 0
    while any(not s.done for s in batch):
        if rounds == 4:
            cancel.set()
        decode_round(target, [s for s in batch if not s.done], costs())
        rounds += 1
    assert seqs[1].gen.finish_reason == "cancelled"
    assert seqs[1].result().token_ids == refs[1][: len(seqs[1].gen.token_ids)]
    assert full.gen.finish_reason == "length" and len(full.ctx) == n_ctx
    for i in (0, 2, 3):
        assert seqs[i].result().token_ids == refs[i], f"slot {i} diverged"


def test_seeded_sampling_under_batching_is_what_it_gives_alone(target, prompts):
    """Each sequence draws from its own generator on its own rows, and rows are bit-identical
    in any batch: with the same k each round (fixed policies; the batch rule may choose
    another k than alone, which draws the random numbers in another order, the distribution
    staying exact) a seeded sampled output is the one the same request gives alone. The
    acceptance rule's distribution is checked in test_sampling_distribution."""
    lookup = PromptLookupDraft()

    def policy(i: int, lookup: Draft) -> FixedPolicy:
        return FixedPolicy(lookup if i % 2 else None, 2 + i)

    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=i) for i in range(4)]
    refs = []
    for i in range(4):
        target.reset()
        refs.append(
            speculative_generate(target, prompts[i], params[i], policy(i + 1, lookup)).token_ids
        )
    for slot in target.slots:
        slot.reset()
    seqs = [
        Sequence(target.slots[i + 2], prompts[i], params[i], policy(i + 1, lookup))
        for i in range(4)
    ]
    run_batch(target, seqs)
    for i, s in enumerate(seqs):
        assert s.result().token_ids == refs[i], f"seeded sampling diverged in slot {i + 2}"


class Exploding(Draft):
    """Fault injected on purpose: a draft that raises on its third proposal."""

    id = kind = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, context, k, params, rng):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("injected draft fault")
        return PromptLookupDraft().propose(context, k, params, rng)


def test_a_draft_that_raises_fails_its_request_alone(target, prompts):
    lookup = PromptLookupDraft()
    refs = [alone(target, p, SamplingParams(max_tokens=30)) for p in prompts[:3]]
    for slot in target.slots:
        slot.reset()
    seqs = [
        Sequence(target.slots[i], prompts[i], SamplingParams(max_tokens=30), policy(i, lookup))
        for i in range(3)
    ]
    bad = Sequence(
        target.slots[3], prompts[3], SamplingParams(max_tokens=30), FixedPolicy(Exploding(), 3)
    )
    run_batch(target, [*seqs, bad])
    assert isinstance(bad.error, RuntimeError) and "injected" in str(bad.error)
    assert len(target.slots[3].tokens) == len(bad.ctx) - 1, "its KV holds what it committed"
    for i, s in enumerate(seqs):
        assert s.result().token_ids == refs[i]


def test_one_sequence_takes_the_single_sequence_path(target, prompts):
    """A batch of one is plain speculative_generate: same output, no batched pass."""
    lookup = PromptLookupDraft()
    ref = alone(target, prompts[0], SamplingParams(max_tokens=24))
    target.slots[4].reset()
    s = Sequence(target.slots[4], prompts[0], SamplingParams(max_tokens=24), FixedPolicy(lookup, 4))
    calls = 0
    eval_many = target.eval_many

    def counting(items):
        nonlocal calls
        calls += 1
        return eval_many(items)

    target.eval_many = counting
    try:
        while not s.done:
            decode_round(target, [s], costs())
    finally:
        del target.eval_many
    assert s.result().token_ids == ref and calls == 0


def test_slot_outputs_are_bit_identical_to_one_sequence_context(target, prompts):
    """The logits of a sequence in slot 5 beside others equal those of the same tokens in a
    context of one sequence (per-sequence KV streams; a unified cache was measured to differ)."""
    require_testbed()
    one = load_backend(models_dir() / TARGET_FILE, BackendOptions(n_ctx=N_CTX))
    try:
        for slot in target.slots:
            slot.reset()
        ref = one.eval(prompts[0])
        outs = target.eval_many(
            [
                (target.slots[5], prompts[0], len(prompts[0])),
                (target.slots[1], prompts[1], 1),
                (target.slots[2], prompts[2], 0),
            ]
        )
        assert np.array_equal(outs[0], ref)
    finally:
        one.close()


def test_features_only_in_a_pass_of_one_sequence(prompts):
    """A target with features (a head in the pool): a pass of one slot returns the rows and
    features of a one-sequence context; a batched pass returns the same logits and no
    features (embeddings mode would output every token of the batch)."""
    require_testbed()
    path = models_dir() / TARGET_FILE
    one = load_backend(path, BackendOptions(n_ctx=N_CTX, features=True))
    many = load_backend(path, BackendOptions(n_ctx=N_CTX, n_seq=3, features=True))
    try:
        ref = one.eval(prompts[0])
        ref_features = one.last_features().copy()
        s0, s1 = many.slots[0], many.slots[1]
        s0.eval(prompts[0][:-4], all_logits=False)
        outs = many.eval_many([(s0, prompts[0][-4:-2], 2), (s1, prompts[2], 0)])
        assert np.array_equal(outs[0], ref[-4:-2]) and len(outs[1]) == 0
        assert s0.features_at(len(prompts[0]) - 3) is None
        alone = many.eval_many([(s0, prompts[0][-2:], 2)])
        assert np.array_equal(alone[0], ref[-2:])
        n = len(prompts[0])
        for pos in (n - 2, n - 1):
            assert np.array_equal(s0.features_at(pos), ref_features[pos])
    finally:
        one.close()
        many.close()


def test_drafts_load_with_one_slot_whatever_the_target_has(tmp_path):
    """Only the target has sequence slots: a draft loaded for a runtime of 4 slots holds one
    KV cache (the load test caught drafts taking the target's 4x KV each)."""
    require_testbed()
    from memspec.config import Settings
    from memspec.runtime import Runtime

    rt = Runtime(
        Settings.load(drafts=["prompt-lookup", "q4_0"], n_ctx=512, parallel=4),
        calibrate_costs=False,
        batched=True,
    )
    try:
        assert len(rt.target.slots) == 4
        q4 = rt.drafts["q4_0"]
        assert q4.backend.options.n_seq == 1 and len(q4.backend.slots) == 1
    finally:
        rt.close()


def test_a_pass_never_exceeds_the_batch_and_a_cancelled_prompt_stops_feeding(target, prompts):
    """Draft depth and prompt chunks are capped by what one pass may carry (n_batch; here
    lowered to 14 tokens for 4 sequences asking for k = 6); a request cancelled while its
    prompt is still being fed stops at once."""
    lookup = PromptLookupDraft()
    refs = [alone(target, p, SamplingParams(max_tokens=24)) for p in prompts[:3]]
    for slot in target.slots:
        slot.reset()
    saved, target.max_batch = target.max_batch, 14
    passes: list[int] = []
    eval_many = target.eval_many

    def counting(items):
        passes.append(sum(len(tokens) for _, tokens, _ in items))
        return eval_many(items)

    target.eval_many = counting
    try:
        seqs = [
            Sequence(
                target.slots[i], prompts[i], SamplingParams(max_tokens=24), FixedPolicy(lookup, 6)
            )
            for i in range(3)
        ]
        gone = threading.Event()
        gone.set()
        cut = Sequence(
            target.slots[3],
            prompts[3] * 3,
            SamplingParams(max_tokens=24),
            FixedPolicy(None, 0),
            cancel=gone,
        )
        run_batch(target, [*seqs, cut])
    finally:
        target.max_batch = saved
        del target.eval_many
    assert max(passes) <= 14
    assert cut.gen.finish_reason == "cancelled" and not cut.gen.token_ids
    for i, s in enumerate(seqs):
        assert s.result().token_ids == refs[i]


def test_a_joining_prompt_is_fed_in_full_chunks_beside_decoding_sequences(target, prompts):
    """The room a pass leaves for prompts is what the verifications do not use: three
    sequences decoding with k ≤ 2 leave a joining prompt its prefill_chunk, not the
    n_batch mod 3 tokens a depth sized by the batch alone left it."""
    lookup = PromptLookupDraft()
    params = SamplingParams(max_tokens=24)
    chunk = 128
    long_prompt = (prompts[3] * 20)[: chunk + 20]
    ref = alone(target, long_prompt, params)
    for slot in target.slots:
        slot.reset()
    seqs = [Sequence(target.slots[i], prompts[i], params, FixedPolicy(lookup, 2)) for i in range(3)]
    for _ in range(3):
        decode_round(target, [s for s in seqs if not s.done], costs())
    joining = Sequence(target.slots[3], long_prompt, params, FixedPolicy(None, 0))
    decode_round(target, [*[s for s in seqs if not s.done], joining], costs(), chunk)
    # One chunk fed; what is left is the rest of the prompt (its last token is the first
    # decoded, never prefilled).
    assert len(joining.to_prefill) == len(long_prompt) - 1 - chunk
    # The next pass carries the rest of the prompt and, with it, the pending token: the
    # first token comes from the pass that ends the prompt.
    decode_round(target, [*[s for s in seqs if not s.done], joining], costs(), chunk)
    assert not joining.to_prefill and len(joining.gen.token_ids) == 1
    run_batch(target, [*seqs, joining])
    assert joining.result().token_ids == ref


def test_four_new_requests_get_their_first_tokens_from_the_pass_that_carries_their_prompts(
    target, prompts
):
    """Four requests arriving at once (nothing decoding): their prompts share one pass, and
    each prompt's last (pending) token rides in it, so every first token comes from that one
    pass rather than from a second round of pending tokens; every answer is its solo one."""
    lookup = PromptLookupDraft()
    params = SamplingParams(max_tokens=16)
    refs = [alone(target, p, params) for p in prompts[4:8]]
    for slot in target.slots:
        slot.reset()
    passes: list[list[tuple[int, int, int]]] = []
    eval_many = target.eval_many

    def counting(items):
        passes.append([(be.seq_id, len(tokens), rows) for be, tokens, rows in items])
        return eval_many(items)

    target.eval_many = counting
    try:
        seqs = [
            Sequence(target.slots[i], prompts[4 + i], params, policy(i, lookup)) for i in range(4)
        ]
        decode_round(target, seqs, costs())
        # One pass: each slot's whole prompt (pending token included), one row each.
        assert passes == [[(i, len(prompts[4 + i]), 1) for i in range(4)]]
        assert [len(s.gen.token_ids) for s in seqs] == [1, 1, 1, 1]
        run_batch(target, seqs)
    finally:
        del target.eval_many
    for s, ref in zip(seqs, refs, strict=True):
        assert s.error is None, s.error
        assert s.result().token_ids == ref


class CountingRule(DecisionRulePolicy):
    """The decision rule over prompt lookup, counting how often it is asked."""

    def __init__(self, costs: CostModel):
        estimator = AcceptanceEstimator(prior_alpha=0.9)  # sure it would pay, alone
        super().__init__([PromptLookupDraft()], costs, estimator, k_max=8)
        self.asked = 0

    def choose(self, context, k_room, params, rng):
        self.asked += 1
        return super().choose(context, k_room, params, rng)


class HeldCosts(CostModel):
    """Costs as given, not moved by the passes this test times: what the batch rule is fed
    stays the test's, whatever load the box is under."""

    def observe_batch(self, n_tokens: int, seconds: float) -> None:
        pass


def test_a_sequence_the_batch_rule_keeps_refusing_stops_asking_its_policy(target, prompts):
    """Where a second ubatch is dear, the batch-level rule refuses the drafts round after
    round; the sequences then back off (speculative.BATCH_BACKOFF_MAX) instead of peeking
    their drafts every round, and every output stays exact."""
    dear = HeldCosts(verify_s=costs().verify_s, batch_s={1: 0.044, 4: 0.07, 8: 0.1, 16: 0.4})
    params = SamplingParams(max_tokens=32)
    texts = [p * 3 for p in prompts[:4]]  # repeats: prompt lookup always finds a match
    refs = [alone(target, t, params) for t in texts]
    for slot in target.slots:
        slot.reset()
    rules = [CountingRule(dear) for _ in texts]
    seqs = [Sequence(target.slots[i], t, params, rules[i]) for i, t in enumerate(texts)]
    while any(s.to_prefill for s in seqs):
        decode_round(target, seqs, dear)
    rounds = 0
    while not all(s.done for s in seqs):
        decode_round(target, [s for s in seqs if not s.done], dear)
        rounds += 1
    for s, ref in zip(seqs, refs, strict=True):
        assert s.result().token_ids == ref
    asked = sum(r.asked for r in rules)
    assert asked < 0.5 * sum(s.gen.rounds for s in seqs), (asked, rounds)
    # Alone, a sequence asks its policy every round: there is no batch rule to refuse.
    for slot in target.slots:
        slot.reset()
    single = CountingRule(dear)
    gen = speculative_generate(target, texts[0], params, single)
    assert gen.token_ids == refs[0] and single.asked == gen.rounds
