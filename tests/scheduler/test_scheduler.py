"""The Runtime's scheduler over a real working set: what it offers the engine each round, and
that every draft it leased or held is let go of when its round and its request end."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.engine.costs import AcceptanceEstimator, CostModel
from memspec.engine.types import Draft, Proposal, SamplingParams
from memspec.errors import InvalidRequest
from memspec.scheduler.draft_choice import DraftAsk
from memspec.scheduler.rounds import Scheduler, chat_text
from memspec.scheduler.working_set import FactorySource, WorkingSet


class EchoDraft(Draft):
    kind = "model"

    def __init__(self, draft_id: str):
        self.id = draft_id

    def propose(self, context, k, params, rng) -> Proposal:
        return Proposal(tokens=[context[-1]] * k, key=self.id)


@pytest.fixture()
def scheduler():
    source = FactorySource(EchoDraft, {"a": 100, "b": 100})
    ws = WorkingSet(source, 1000, 0)
    ws.load("a")
    sched = Scheduler(ws, CostModel(verify_s=[1.0] * 9), AcceptanceEstimator(), 8)
    yield sched
    ws.close()


def in_use(sched: Scheduler) -> dict[str, bool]:
    return {r["id"]: r["in_use"] for r in sched.ws.status()}


def test_a_named_draft_is_held_and_leased_only_while_its_request_runs(scheduler):
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=4)
    scheduler.begin([1, 2, 3], params, draft=DraftAsk(named="a"), k=2)
    with scheduler.ws.leased():  # a round (Runtime.decode_round)
        choice = scheduler.choose([1, 2, 3], 4, params, rng)
        assert choice.draft is not None and choice.draft.id == "a" and choice.k == 2
        assert in_use(scheduler)["a"]
    scheduler.finish()
    assert in_use(scheduler) == {"a": False, "b": False}


def test_none_decodes_without_a_draft(scheduler):
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=4)
    scheduler.begin([1, 2, 3], params, draft=DraftAsk(plain=True))
    assert scheduler.choose([1, 2, 3], 4, params, rng).draft is None
    scheduler.abort()
    assert not any(in_use(scheduler).values())


def test_a_named_policy_decides_and_counts_its_rounds(scheduler):
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=4)
    scheduler.begin([1, 2, 3], params, policy="fixed:a")
    with scheduler.ws.leased():
        choice = scheduler.choose([1, 2, 3], 4, params, rng)
        assert choice.draft is not None and choice.draft.id == "a"
        scheduler.observe("a", choice.k, 1, 0.01)
    stats = scheduler.finish()
    assert stats.rounds == 1 and stats.drafts_used == {"a": 1}
    assert not any(in_use(scheduler).values())
    assert "fixed:a" in scheduler.status()["policies"]


def test_an_unknown_policy_is_refused_by_name(scheduler):
    with pytest.raises(InvalidRequest, match="unknown policy 'bogus'; known: auto, exp3"):
        scheduler.begin([1], SamplingParams(), policy="bogus")
    assert scheduler.names == ("auto", "memspec", "ucb", "exp3", "fixed:a", "fixed:b")


def test_the_predictor_reads_the_last_user_message_and_the_turns():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": " And 2 + 2? "},
    ]
    assert chat_text(messages) == ("And 2 + 2?", 2)
    assert chat_text(None, "a plain prompt") == ("a plain prompt", 1)
