"""Which sequence slots of a target are taken: one SlotTable per Runtime owns that.

A target decodes up to `n_seq` sequences together, each over its own KV cache (the
backend's `slots`; the lead slot may use every draft kind). The table knows which slots
hold a sequence now and chooses the slot a new request takes; the backend owns what each
slot's KV cache holds (its tokens and partition), which the choice reads. Engine thread
only: the daemon's worker takes a slot when a request joins the batch and releases it when
its sequence ends, however it ends.
"""

from __future__ import annotations

from memspec.backends.base import Backend, common_prefix

# A slot's KV cache must share this many more prompt tokens than the lead slot's to draw a
# request away from the lead (the prefix cache's own threshold for a restore).
SLOT_GAIN_TOKENS = 16


def id_runs(ids: set[int]) -> int:
    """How many runs of consecutive integers `ids` makes ({0, 1, 2, 5}: 2)."""
    return sum(1 for i in ids if i - 1 not in ids)


class SlotTable:
    """The occupancy of one target's sequence slots (`slots`: the backend's, by seq_id;
    `lead`: the lead slot's id, scheduler.rounds.LEAD_SLOT)."""

    def __init__(self, slots: list[Backend], *, lead: int):
        self._slots = list(slots)
        self.lead = lead
        self._busy: set[int] = set()

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def capacity(self) -> int:
        return len(self._slots)

    def busy(self) -> frozenset[int]:
        """The slots holding a sequence now."""
        return frozenset(self._busy)

    def free(self) -> int:
        """How many slots a request could take now."""
        return len(self._slots) - len(self._busy)

    def take(self, prompt: list[int], partition: str = "") -> int | None:
        """Take a free slot for `prompt` of `partition` (None when all are busy). First, one
        that keeps the busy slots' ids in as few consecutive runs as it can: llama.cpp splits
        a pass over per-sequence KV streams into one ubatch per run of consecutive ids, each
        reading all the weights (4 sequences × 1 token here: 73 ms on slots 0-3, 108 ms on
        0, 4, 5, 6, 171 ms on 0, 2, 5, 7). Among those, the lead slot, whose sequence may use
        every draft kind, unless another slot's KV cache shares clearly more of the prompt (a
        conversation's follow-up goes back to its slot). Off the lead: the longest shared
        prefix, else the slot holding least (live KV of other conversations is kept for
        their follow-ups; the prefix cache has the rest). A slot holding another partition's
        prompt shares nothing with this one."""
        slot = self._choose(prompt, partition)
        if slot is not None:
            assert slot not in self._busy, f"slot {slot} is taken twice"
            self._busy.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """The sequence in `slot` has ended (finished, failed, cancelled or never opened)."""
        if slot not in self._busy:
            raise RuntimeError(f"slot {slot} is released but was not taken")
        self._busy.remove(slot)

    def _choose(self, prompt: list[int], partition: str) -> int | None:
        busy = self._busy
        free = [s for s in self._slots if s.seq_id not in busy]
        if not free:
            return None
        runs = {s.seq_id: id_runs(busy | {s.seq_id}) for s in free}
        fewest = min(runs.values())
        free = [s for s in free if runs[s.seq_id] == fewest]
        shared = {
            s.seq_id: common_prefix(s.tokens, prompt) if s.kv_partition == partition else 0
            for s in free
        }
        best = max(free, key=lambda s: (shared[s.seq_id], -len(s.tokens), -s.seq_id))
        lead = self.lead
        if lead in shared and shared[best.seq_id] < shared[lead] + SLOT_GAIN_TOKENS:
            return lead
        if shared[best.seq_id] < SLOT_GAIN_TOKENS:
            return min(free, key=lambda s: (len(s.tokens), s.seq_id)).seq_id
        return best.seq_id
