"""Runtime.pick_slot: which free sequence slot a new request takes."""

from __future__ import annotations

from types import SimpleNamespace

from memspec.runtime import SLOT_GAIN_TOKENS, Runtime, id_runs


def pick(busy: set[int], holding: dict[int, list[int]] | None = None, prompt=(1, 2, 3)) -> int:
    holding = holding or {}
    slots = [
        SimpleNamespace(seq_id=i, tokens=holding.get(i, []), kv_partition="") for i in range(8)
    ]
    rt = SimpleNamespace(target=SimpleNamespace(slots=slots))
    return Runtime.pick_slot(rt, list(prompt), busy)  # type: ignore[arg-type]


def test_id_runs():
    assert id_runs(set()) == 0
    assert id_runs({3}) == 1
    assert id_runs({0, 1, 2, 5}) == 2
    assert id_runs({0, 2, 5, 7}) == 4


def test_busy_slots_stay_consecutive():
    # llama.cpp runs one ubatch per run of consecutive sequence ids: a gap is a whole pass.
    assert pick(set()) == 0  # alone: the lead, which may use every draft kind
    assert pick({0, 1, 2}) == 3
    assert pick({0, 1, 3}) == 2  # fills the gap a finished request left
    assert pick({1, 2}) in (0, 3)


def test_a_follow_up_goes_back_to_its_slot_when_that_keeps_the_runs():
    conversation = list(range(100, 100 + 2 * SLOT_GAIN_TOKENS))
    assert pick({0, 1, 2}, {3: conversation}, conversation + [7]) == 3
    # Its slot would split the busy ones: a slot next to them wins, the prefix cache has the rest.
    assert pick({0, 1, 2}, {6: conversation}, conversation + [7]) == 3
    assert pick({0}, {5: conversation}, conversation + [7]) == 1
