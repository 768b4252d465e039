"""Leases between rounds: releasing them wakes the loader only when it waits on them.

The engine leases the drafts it may use every round and releases them as it ends; a wake-up
of the loader thread per round made it re-plan (and switch threads on the cores the model
decodes on) for nothing. No model is loaded here: prompt lookup stands in for any draft.
"""

from __future__ import annotations

import threading

from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.scheduler.working_set import DraftState, FactorySource, WorkingSet


def working_set() -> tuple[WorkingSet, list[int]]:
    source = FactorySource(lambda i: PromptLookupDraft(i), {"a": 1000, "b": 1000})
    ws = WorkingSet(source, budget_bytes=10_000, autoload_free=False)
    ws.load("a")
    ws.load("b")
    assert ws.wait_idle(timeout=10)
    kicks: list[int] = []
    kick = ws._kick

    def counted() -> None:
        kicks.append(1)
        kick()

    ws._kick = counted  # type: ignore[method-assign]
    return ws, kicks


def test_a_round_of_leases_does_not_wake_the_loader():
    ws, kicks = working_set()
    try:
        for _ in range(50):  # fifty rounds: lease what is resident, released as each ends
            with ws.leased():
                assert [d.id for d in ws.lease_resident()] == ["a", "b"]
        assert kicks == []
        assert ws.wait_idle(timeout=0)  # nothing was left for it to do
    finally:
        ws.close()


def test_releasing_a_draft_the_loader_waits_to_close_wakes_it():
    ws, kicks = working_set()
    try:
        evicting = threading.Thread(target=ws.evict, args=("a",))
        with ws.leased():  # a round that uses "a"
            ws.lease_resident(["a"])
            evicting.start()  # marks it EVICTING, then waits for the lease to go
            while ws.state("a") != DraftState.EVICTING:
                evicting.join(timeout=0.01)
            kicks.clear()
        assert kicks == [1]
        evicting.join(timeout=10)
        assert not evicting.is_alive() and ws.state("a") == DraftState.ABSENT
    finally:
        ws.close()
