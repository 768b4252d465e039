"""SlotTable: which sequence slots of a target are taken, and which free one a request takes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from launcher import TARGET_FILE, require_testbed

from memspec.backends.base import BackendOptions, load_backend
from memspec.engine.slots import SLOT_GAIN_TOKENS, SlotTable, id_runs
from memspec.paths import models_dir
from memspec.scheduler.rounds import LEAD_SLOT

CONVERSATION = "The quick brown fox jumps over the lazy dog while the farmer watches. " * 3
OTHER = "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. " * 2


@pytest.fixture(scope="module")
def backend():
    """The testbed target with four sequence slots (one thread: the test box is shared)."""
    require_testbed()
    be = load_backend(models_dir() / TARGET_FILE, BackendOptions(n_ctx=256, n_threads=1, n_seq=4))
    yield be
    be.close()


@pytest.fixture()
def table(backend):
    for slot in backend.slots:
        slot.reset()
        slot.kv_partition = ""
    return SlotTable(backend.slots, lead=LEAD_SLOT)


def test_take_release_busy_free(table, backend):
    prompt = backend.tokenize(OTHER)
    assert len(table) == table.capacity == 4
    assert table.busy() == frozenset() and table.free() == 4
    assert table.take(prompt) == LEAD_SLOT  # alone: the lead, which may use every draft kind
    assert table.busy() == {0} and table.free() == 3
    assert [table.take(prompt) for _ in range(3)] == [1, 2, 3]  # the busy ids stay consecutive
    assert table.busy() == {0, 1, 2, 3} and table.free() == 0
    assert table.take(prompt) is None  # full
    table.release(2)
    assert table.busy() == {0, 1, 3} and table.free() == 1
    assert table.take(prompt) == 2  # the gap a finished request left
    table.release(0)
    assert table.take(prompt) == LEAD_SLOT


def test_releasing_a_free_slot_is_a_bug(table, backend):
    with pytest.raises(RuntimeError):
        table.release(1)  # never taken
    slot = table.take(backend.tokenize(OTHER))
    assert slot is not None
    table.release(slot)
    with pytest.raises(RuntimeError):
        table.release(slot)  # twice
    assert table.free() == 4


def test_a_follow_up_goes_back_to_the_slot_holding_its_conversation(table, backend):
    conversation = backend.tokenize(CONVERSATION)
    assert len(conversation) >= 2 * SLOT_GAIN_TOKENS
    backend.slots[2].eval(conversation, all_logits=False)
    follow_up = conversation + backend.tokenize(" And then?", add_bos=False)
    assert table.take(backend.tokenize(OTHER)) == LEAD_SLOT  # shares nothing: the lead
    table.release(LEAD_SLOT)
    assert table.take(follow_up) == 2  # clearly more than the lead shares: its own slot
    table.release(2)
    # The lead holding the same conversation keeps the request (it shares as much).
    backend.slots[0].eval(conversation, all_logits=False)
    assert table.take(follow_up) == LEAD_SLOT
    table.release(LEAD_SLOT)
    # Another partition's KV shares nothing with this one's prompt.
    backend.slots[0].reset()
    backend.slots[2].kv_partition = "someone else"
    assert table.take(follow_up) == LEAD_SLOT


def test_a_short_shared_prefix_does_not_draw_a_request_off_the_lead(table, backend):
    conversation = backend.tokenize(CONVERSATION)
    few = conversation[: SLOT_GAIN_TOKENS - 1]
    backend.slots[3].eval(few, all_logits=False)
    assert table.take(few + backend.tokenize(OTHER, add_bos=False)) == LEAD_SLOT


# --- the choice rules on slots that only hold token lists --------------------------------


def pick(busy: set[int], holding: dict[int, list[int]] | None = None, prompt=(1, 2, 3)) -> int:
    """The slot a request for `prompt` takes while `busy` are taken (8 slots)."""
    holding = holding or {}
    slots = [
        SimpleNamespace(seq_id=i, tokens=holding.get(i, []), kv_partition="") for i in range(8)
    ]
    table = SlotTable(slots, lead=LEAD_SLOT)  # type: ignore[arg-type]
    for _ in range(max(busy, default=-1) + 1):  # empty slots are taken in id order
        table.take([])
    for slot in set(range(max(busy, default=-1) + 1)) - busy:
        table.release(slot)
    assert table.busy() == busy
    slot = table.take(list(prompt))
    assert slot is not None and slot in table.busy()
    return slot


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
