"""A round's bookkeeping and its draft leases, over the stub target (no model).

What a Generation records per round (phases, counts per draft, k per round), what the round's
policy is told (its costs when a sequence decodes alone, its acceptance when it drafted), and
that a draft leased for a round is let go of when the round ends, however it ends.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from memspec.backends.base import SequenceSlot
from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.costs import AcceptanceEstimator, CostModel, RoundCosts
from memspec.engine.generation import ROUND_PHASES
from memspec.engine.policy import FixedPolicy
from memspec.engine.speculative import Sequence, decode_round
from memspec.engine.types import Draft, Proposal, SamplingParams
from memspec.runtime import Runtime
from memspec.scheduler.draft_choice import DraftAsk
from memspec.scheduler.rounds import Scheduler
from memspec.scheduler.working_set import FactorySource, WorkingSet
from memspec_lab.stub_backend import StubBackend


class Recording(FixedPolicy):
    """A fixed (draft, k) that keeps what the round tells it."""

    def __init__(self, draft: Draft | None, k: int):
        super().__init__(draft, k)
        self.observed: list[tuple[str, int, int]] = []
        self.costs: list[RoundCosts] = []

    def observe(self, key, proposed, accepted, seconds) -> None:
        assert seconds >= 0
        self.observed.append((key, proposed, accepted))

    def observe_costs(self, measured: RoundCosts) -> None:
        self.costs.append(measured)


class TwoSlots(StubBackend):
    """The stub with a second sequence slot: a row depends on its input token alone, so a
    batched pass is each entry's rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots.append(SequenceSlot(self, 1))

    def _forward_many(self, entries):
        outs = []
        for seq_id, past, tokens, rows in entries:
            out = self._forward_seq(seq_id, past, tokens, rows > 1, True)[0]
            outs.append(out[len(out) - rows :])
        return outs, [None] * len(entries)


@pytest.fixture()
def stub(tmp_path) -> StubBackend:
    return TwoSlots(tmp_path / "stub.gguf", n_vocab=2048, n_ctx=512)


def prompt_of(stub: StubBackend) -> list[int]:
    return stub.cycle * 2  # the lookup finds the cycle: every drafted token is the target's


def run(target, seqs: list[Sequence], costs: CostModel | None = None) -> dict[int, int]:
    """Rounds until every sequence is done; the rounds each decoded alone, by slot."""
    alone = dict.fromkeys(range(len(seqs)), 0)
    while not all(s.done for s in seqs):
        active = [s for s in seqs if not s.done]
        if len(active) == 1 and not active[0].to_prefill:
            alone[active[0].target.seq_id] += 1
        decode_round(target, active, costs)
    return alone


def check_counts(gen, policy: Recording, draft_id: str) -> None:
    """The Generation's counts agree with one another and with what the policy was told."""
    drafted = [k for k in gen.k_per_round if k > 0]
    assert gen.rounds == len(gen.k_per_round)
    assert gen.proposed == sum(drafted) == sum(p for _, p, _ in policy.observed)
    assert gen.accepted == sum(a for _, _, a in policy.observed)
    assert gen.drafts_used == ({draft_id: len(drafted)} if drafted else {})
    if drafted:
        assert gen.per_draft == {draft_id: {"proposed": gen.proposed, "accepted": gen.accepted}}
    assert set(gen.phases) == set(ROUND_PHASES)
    assert all(v >= 0 for v in gen.phases.values())


def test_a_round_alone_records_its_phases_counts_and_feedback(stub):
    lookup = PromptLookupDraft()
    policy = Recording(lookup, 4)
    prompt = prompt_of(stub)
    seq = Sequence(stub, prompt, SamplingParams(max_tokens=21), policy)
    run(stub, [seq])
    gen = seq.result()
    assert gen.token_ids == (stub.cycle * 3)[len(prompt) % 32 :][:21]
    assert gen.finish_reason == "length" and gen.completion_tokens == 21
    check_counts(gen, policy, lookup.id)
    assert gen.accepted == gen.proposed > 0  # the lookup is always right on the cycle
    assert gen.k_per_round[0] == 4  # each round drafts k: 4 drafted + the target's own
    assert len(policy.costs) == gen.rounds  # alone: every round tells the policy its costs
    assert [c.drafted for c in policy.costs] == gen.k_per_round
    assert all(c.draft_id == lookup.id for c in policy.costs if c.drafted > 0)
    assert gen.phases["verify_decode"] > 0 and gen.ttft_s > 0


def test_plain_rounds_record_one_token_each_and_no_draft(stub):
    policy = Recording(None, 0)
    seq = Sequence(stub, prompt_of(stub), SamplingParams(max_tokens=7), policy)
    run(stub, [seq])
    gen = seq.result()
    assert gen.rounds == 7 and gen.k_per_round == [0] * 7
    assert gen.proposed == gen.accepted == 0 and gen.drafts_used == {} and gen.per_draft == {}
    assert policy.observed == [] and len(policy.costs) == 7
    check_counts(gen, policy, "none")


def test_a_stop_token_ends_the_round_and_nothing_after_it_is_kept(stub):
    policy = Recording(PromptLookupDraft(), 8)
    prompt = prompt_of(stub)
    stop = stub.cycle[5]
    seq = Sequence(stub, prompt, SamplingParams(max_tokens=40, stop_token_ids={stop}), policy)
    run(stub, [seq])
    gen = seq.result()
    assert gen.finish_reason == "stop" and gen.token_ids == stub.cycle[:5]
    check_counts(gen, policy, "prompt-lookup")


def test_batched_rounds_record_each_sequence_and_the_batch_its_cost(stub):
    """Two sequences share each pass: each records its own rounds and acceptance; the pass's
    cost is the batch's (costs.observe_batch), not told to either policy."""
    lookups = [PromptLookupDraft(), PromptLookupDraft()]
    policies = [Recording(lookups[0], 3), Recording(None, 0)]
    prompt = prompt_of(stub)
    seqs = [
        Sequence(slot, prompt, SamplingParams(max_tokens=n), p)
        for slot, p, n in zip(stub.slots, policies, (13, 9), strict=True)
    ]
    costs = CostModel(verify_s=[0.01] * 9)
    alone = run(stub, seqs, costs)
    want = (stub.cycle * 3)[len(prompt) % 32 :]
    for seq, policy, n in zip(seqs, policies, (13, 9), strict=True):
        gen = seq.result()
        assert gen.token_ids == want[:n]
        check_counts(gen, policy, "prompt-lookup")
        assert len(policy.costs) == alone[seq.target.seq_id]  # told costs only when alone
    assert alone[0] == 0 and alone[1] > 0  # the plain one decodes its last tokens alone


def test_a_failing_draft_fails_its_request_alone(stub):
    class Broken(PromptLookupDraft):
        def propose(self, context, k, params, rng) -> Proposal:
            raise RuntimeError("draft broke")

    good = Sequence(
        stub.slots[0], prompt_of(stub), SamplingParams(max_tokens=5), Recording(None, 0)
    )
    bad = Sequence(
        stub.slots[1], prompt_of(stub), SamplingParams(max_tokens=5), Recording(Broken(), 2)
    )
    run(stub, [good, bad])
    assert isinstance(bad.error, RuntimeError)
    assert bad.gen.token_ids == stub.cycle[:1]  # only the token its prompt's pass gave
    assert good.error is None and good.result().completion_tokens == 5


# --- leases: one round's drafts, released when it ends ------------------------------------------
class Spy(Draft):
    """A model-like draft that notes whether it is leased while it proposes, and can fail."""

    kind = "model"
    ws: WorkingSet | None = None
    raises: BaseException | None = None
    on_propose: threading.Event | None = None  # set while proposing (a client leaving)
    seen_in_use: list[bool] = []

    def __init__(self, draft_id: str):
        self.id = draft_id

    def propose(self, context, k, params, rng) -> Proposal:
        assert Spy.ws is not None
        Spy.seen_in_use.append(in_use(Spy.ws)[self.id])
        if Spy.on_propose is not None:
            Spy.on_propose.set()
        if Spy.raises is not None:
            raise Spy.raises
        return Proposal(tokens=[context[-1]] * k, key=self.id)


def in_use(ws: WorkingSet) -> dict[str, bool]:
    """Leased now (by any thread): a hold (a request that named it) does not count."""
    return {i: s.uses > 0 for i, s in ws._slots.items()}


class Interrupt(BaseException):
    """Not an Exception: no request swallows it, so it leaves the round."""


@pytest.fixture()
def leased(stub):
    ws = WorkingSet(FactorySource(Spy, {"a": 100}), budget_bytes=1000, autoload_free=False)
    ws.load("a")
    Spy.ws, Spy.raises, Spy.on_propose, Spy.seen_in_use = ws, None, None, []
    sched = Scheduler(ws, CostModel(verify_s=[1.0] * 9), AcceptanceEstimator(), 8)
    rt = SimpleNamespace(  # what Runtime.decode_round reads: the daemon's round itself
        _ws=ws,
        lock=threading.Lock(),
        target=stub,
        costs=None,
        settings=SimpleNamespace(prefill_chunk=512),
    )

    def sequence(cancel: threading.Event | None = None) -> Sequence:
        params = SamplingParams(max_tokens=6)
        sched.begin(prompt_of(stub), params, draft=DraftAsk(named="a"), k=2)
        return Sequence(stub, prompt_of(stub), params, sched, cancel=cancel)

    def round_of(seq: Sequence) -> None:
        Runtime.decode_round(rt, [seq])  # type: ignore[arg-type]
        assert not any(in_use(ws).values())  # the round's end let go of its draft

    yield ws, sched, sequence, round_of
    Spy.ws = None
    ws.close()


def test_a_rounds_draft_is_leased_during_it_and_released_when_it_ends(leased):
    ws, sched, sequence, round_of = leased
    seq = sequence()
    while not seq.done:
        round_of(seq)
        assert not any(in_use(ws).values())
    sched.finish()
    assert Spy.seen_in_use and all(Spy.seen_in_use)  # leased while it proposed, every round
    assert seq.result().completion_tokens == 6


def test_a_round_that_raises_releases_its_draft(leased):
    ws, sched, sequence, round_of = leased
    seq = sequence()
    round_of(seq)  # its prompt
    Spy.raises = Interrupt()
    with pytest.raises(Interrupt):
        round_of(seq)
    assert Spy.seen_in_use == [True] and not any(in_use(ws).values())
    sched.abort()


def test_a_draft_that_fails_its_request_is_released(leased):
    ws, sched, sequence, round_of = leased
    seq = sequence()
    round_of(seq)  # its prompt
    Spy.raises = RuntimeError("draft broke")
    round_of(seq)
    assert seq.done and isinstance(seq.error, RuntimeError)
    assert Spy.seen_in_use == [True] and not any(in_use(ws).values())
    sched.abort()


def test_a_cancelled_sequence_lets_go_of_its_draft(leased):
    ws, sched, sequence, round_of = leased
    cancel = threading.Event()
    Spy.on_propose = cancel  # the client leaves while the draft proposes
    seq = sequence(cancel)
    round_of(seq)  # its prompt
    round_of(seq)
    assert not seq.done and not any(in_use(ws).values())
    round_of(seq)  # the next round sees the cancel
    assert seq.done and seq.gen.finish_reason == "cancelled"
    assert Spy.seen_in_use == [True] and not any(in_use(ws).values())
    sched.abort()
