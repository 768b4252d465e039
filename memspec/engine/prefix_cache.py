"""Multi-session prefix cache: KV snapshots of earlier conversations, byte-bounded, LRU.

A backend keeps one KV cache, so the engine reuses the longest common prefix between a new
prompt and whatever that cache holds now: a follow-up turn of the *last* conversation reuses
its KV. When conversations interleave, the next request would throw that KV away. Before it
does, the live cache is snapshotted here; a later request whose prompt extends a snapshot much
further than the live cache gets it restored first, then the engine's prefix reuse does the
rest. Snapshots are counted in bytes, bounded by `prefix_cache` and by what the memory budget
leaves after the models, and the least recently used go first.

Only backends with `supports_kv_snapshot` take part; everything else keeps plain prefix reuse.
Called on the engine thread only, between generations (Runtime.prepare_prefix).

Partitions: a prompt's KV is reused only by requests of the same partition (the daemon's: the
API key and `cache_salt`). A prefix reused from another client's prompt would show in
`cached_tokens` and in the time to the first token how much of it that client also sent
(vLLM's CVE-2025-46570). So a live cache holding another partition's prompt is saved aside
and emptied first, and snapshots are matched within their partition only.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from memspec.backends.base import Backend, KVSnapshot, common_prefix

log = logging.getLogger(__name__)

MIN_SAVE_TOKENS = 16  # a live cache losing fewer tokens than this is not worth a snapshot
MIN_GAIN_TOKENS = 16  # restore only when a snapshot beats the live cache by this much


@dataclass
class _Entry:
    # The backend (model + context) the snapshot belongs to; any of its sequence slots can
    # restore it (Backend.kv_owner).
    owner: weakref.ref[Backend]
    snapshot: KVSnapshot
    partition: str = ""
    last_used: float = field(default_factory=time.monotonic)

    def held_for(self, backend: Backend, partition: str) -> bool:
        """Whether `backend` (any slot of its context) may restore it for `partition`."""
        return self.owner() is backend.kv_owner and self.partition == partition


@dataclass
class CacheStats:
    saves: int = 0
    restores: int = 0
    evictions: int = 0
    restored_tokens: int = 0


class PrefixCache:
    def __init__(self, capacity: Callable[[], int]):
        """`capacity()` gives the byte bound now (it follows live budget changes)."""
        self._capacity = capacity
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()  # status readers vs the engine thread
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.snapshot.nbytes for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def drop_partition(self, head: str) -> None:
        """Drop the snapshots of partitions headed `head` + NUL (an unloaded model's: the
        daemon heads a request's partition with its model's name)."""
        prefix = head + "\x00"
        with self._lock:
            self._entries = [e for e in self._entries if not e.partition.startswith(prefix)]

    def forget(self, keep: list[Backend]) -> None:
        """Drop snapshots of backends no longer loaded (an evicted draft, a reloaded target)."""
        with self._lock:
            self._entries = [e for e in self._entries if any(e.owner() is b for b in keep)]

    def enabled_for(self, backend: Backend) -> bool:
        """Whether this cache keeps snapshots of `backend` (it has some room, and the backend
        can be snapshotted)."""
        return backend.supports_kv_snapshot and self._capacity() > 0

    def prepare(self, backend: Backend, prompt: list[int], partition: str = "") -> int:
        """Make `backend`'s KV cache the best available start for `prompt` of `partition`.

        Returns the number of prompt tokens a restored snapshot covers (0: nothing restored).
        """
        enabled = self.enabled_for(backend)
        if backend.kv_partition != partition:
            if enabled and len(backend.tokens) >= MIN_SAVE_TOKENS:
                self._save(backend)  # its own client may come back for it
            backend.reset()  # never a prefix for another partition's prompt
            backend.kv_partition = partition
        if not enabled:
            return 0
        live = common_prefix(backend.tokens, prompt)
        best, best_n = None, live
        with self._lock:
            for e in self._entries:
                if e.held_for(backend, partition):
                    n = common_prefix(e.snapshot.tokens, prompt)
                    if n > best_n:
                        best, best_n = e, n
        losing = len(backend.tokens) - live
        if best is not None and best_n >= live + MIN_GAIN_TOKENS:
            # The snapshot stays for the next slot that wants it: concurrent requests with one
            # prompt (a shared system prompt, a retried question) each restore it. Moving it
            # out made the second prefill the whole prompt, and how often that happened set a
            # batch's rate more than its policy did (docs/batching.md, tenth stop). Touched
            # first, so the save below does not evict it as the least recently used.
            best.last_used = time.monotonic()
            if losing >= MIN_SAVE_TOKENS:
                self._save(backend)
            if backend.kv_restore(best.snapshot):
                self.stats.restores += 1
                self.stats.restored_tokens += best_n
                return best_n
            log.warning("KV snapshot restore failed; prefilling instead")
            backend.reset()
            return 0
        if losing >= MIN_SAVE_TOKENS:
            self._save(backend)
        return 0

    def _save(self, backend: Backend) -> None:
        tokens, partition = backend.tokens, backend.kv_partition
        with self._lock:
            for e in self._entries:
                held = e.held_for(backend, partition)
                if held and common_prefix(e.snapshot.tokens, tokens) == len(tokens):
                    e.last_used = time.monotonic()
                    return  # already held by a longer (or equal) snapshot
        cap = self._capacity()
        snap = backend.kv_snapshot()
        if snap is None or snap.nbytes > cap:
            return
        with self._lock:
            # A snapshot that is a prefix of the new one is superseded by it.
            self._entries = [
                e
                for e in self._entries
                if not (
                    e.held_for(backend, partition)
                    and common_prefix(e.snapshot.tokens, tokens) == len(e.snapshot.tokens)
                )
            ]
            self._entries.append(_Entry(weakref.ref(backend.kv_owner), snap, partition=partition))
            self.stats.saves += 1
            self._shrink(cap)

    def shrink(self) -> None:
        """Evict down to the current capacity (after a budget change)."""
        cap = self._capacity()
        with self._lock:
            self._shrink(cap)

    def _shrink(self, cap: int) -> None:
        total = sum(e.snapshot.nbytes for e in self._entries)
        self._entries.sort(key=lambda e: e.last_used)
        while self._entries and total > cap:
            total -= self._entries.pop(0).snapshot.nbytes
            self.stats.evictions += 1


def share_slot_prefix(
    slot: Backend, others: list[Backend], free: list[Backend], prompt: list[int], park: bool
) -> int:
    """The other sequence slots of `slot`'s context hold other conversations' KV. Ready `slot`
    for `prompt` from the one that shares the most with it (copied in as a snapshot is
    restored), when that beats what `slot` holds by MIN_GAIN_TOKENS: a chat's system prompt
    in another slot is not computed again. First, with `park` (no prefix cache keeps what
    `slot` is about to lose), move a conversation worth keeping into a `free` slot, an empty
    one else the one holding least: a single stream runs every request on the lead slot, and
    without this each request threw the last one's KV away where llama-server's slots keep
    it (measured: 0 of 1218 prompt tokens reused against its 172). `others`: slots that may
    be read (busy ones too: this runs between rounds); `free`: slots that may be written, in
    the same partition as `slot`. Returns the prompt tokens the copy covers (0: none)."""
    if not slot.supports_kv_snapshot:
        return 0
    live = common_prefix(slot.tokens, prompt)
    shared, donor = max(
        (
            (common_prefix(s.tokens, prompt), s)
            for s in others
            if s is not slot and s.kv_partition == slot.kv_partition
        ),
        key=lambda pair: pair[0],
        default=(0, None),
    )
    borrow = donor is not None and shared >= live + MIN_GAIN_TOKENS
    if park and len(slot.tokens) - live >= MIN_SAVE_TOKENS:
        spots = [s for s in free if s is not slot and not (borrow and s is donor)]
        spot = min(spots, key=lambda s: len(s.tokens), default=None)
        if spot is not None and len(spot.tokens) < len(slot.tokens):
            snapshot = slot.kv_snapshot()
            if snapshot is not None and spot.kv_restore(snapshot):
                spot.kv_partition = slot.kv_partition
    if not borrow:
        return 0
    assert donor is not None
    snapshot = donor.kv_snapshot()
    if snapshot is None:
        return 0
    if not slot.kv_restore(snapshot):
        log.warning("copying another slot's KV failed; prefilling instead")
        slot.reset()  # the slot's tokens must say what its cache holds
        return 0
    return shared
