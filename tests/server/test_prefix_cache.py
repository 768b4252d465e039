"""The multi-session prefix cache on a real llama.cpp backend: snapshots restore the exact KV,
stay within their byte bound, and never cross backends."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.engine.prefix_cache import (
    MIN_GAIN_TOKENS,
    MIN_SAVE_TOKENS,
    PrefixCache,
    share_slot_prefix,
)
from memspec.paths import models_dir

pytestmark = pytest.mark.models  # needs the testbed models (not in --quick)

A = "The quick brown fox jumps over the lazy dog while the farmer watches from the gate. " * 2
B = "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in leaves. " * 2


def _load(name: str, n_seq: int = 1):
    # One thread: the test box is shared, and llama.cpp threads spin when cores are busy.
    return load_backend(models_dir() / name, BackendOptions(n_ctx=256, n_threads=1, n_seq=n_seq))


@pytest.fixture()
def small_backend():
    be = _load("smollm2-135m-f32.gguf")
    yield be
    be.close()


def greedy(be, prompt: list[int], n: int = 6) -> list[int]:
    """Prefill what the cache lacks, then n greedy tokens (the engine's prefix-reuse rule)."""
    kept = be.reuse_prefix(prompt[:-1])
    if kept < len(prompt) - 1:
        be.eval(prompt[kept:-1], all_logits=False)
    out, last = [], prompt[-1]
    for _ in range(n):
        tok = int(np.argmax(be.eval([last])[-1]))
        out.append(tok)
        last = tok
    return out


def test_restore_is_exact_and_interleaving_reuses(small_backend):
    be = small_backend
    cache = PrefixCache(lambda: 64 << 20)
    a = be.tokenize(A)
    b = be.tokenize(B)
    ref_a = greedy(be, a)
    be.reset()

    cache.prepare(be, a)
    assert greedy(be, a) == ref_a
    a_kv = list(be.tokens)
    assert cache.prepare(be, b) == 0  # a different conversation: A's KV is saved first
    assert len(cache) == 1 and cache.nbytes > 0
    greedy(be, b)
    follow_up = a_kv + be.tokenize(" And then?", add_bos=False)
    restored = cache.prepare(be, follow_up)  # A comes back; B is saved in its place
    assert restored == len(a_kv)
    assert be.tokens == a_kv and len(cache) == 2  # A's snapshot stays for other slots
    assert cache.stats.restores == 1 and cache.stats.saves == 2
    be.truncate(len(a) - 1)
    assert greedy(be, a) == ref_a  # the restored KV gives the same greedy continuation


def test_two_slots_restore_one_snapshot():
    """Two requests with one prompt on two slots: both start from the snapshot, exactly."""
    be = _load("smollm2-135m-f32.gguf", n_seq=2)
    try:
        cache = PrefixCache(lambda: 64 << 20)
        first, second = be.slots
        a, b = be.tokenize(A), be.tokenize(B)
        ref_a = greedy(first, a)
        assert cache.prepare(first, b) == 0  # the slot moves on: A is saved
        greedy(first, b)
        assert cache.prepare(second, a) == len(a)
        assert cache.prepare(first, a) == len(a)  # still there for the other slot
        for slot in (first, second):
            slot.truncate(len(a) - 1)
            assert greedy(slot, a) == ref_a
        assert cache.stats.restores == 2
    finally:
        be.close()


def test_byte_bound_and_supersede(small_backend):
    be = small_backend
    cap = [1 << 30]
    cache = PrefixCache(lambda: cap[0])
    a = be.tokenize(A)
    be.eval(a[:24], all_logits=False)
    cache.prepare(be, be.tokenize(B))  # saves a 24-token prefix of A
    one = cache.nbytes
    be.reset()
    be.eval(a, all_logits=False)
    cache.prepare(be, be.tokenize(B))  # A's full KV supersedes its own prefix
    assert len(cache) == 1 and cache.nbytes > one
    cap[0] = one  # a budget cut: the cache shrinks to fit
    cache.shrink()
    assert cache.nbytes <= one and cache.stats.evictions == 1
    be.reset()
    be.eval(a[: MIN_SAVE_TOKENS - 1], all_logits=False)
    cache.prepare(be, be.tokenize(B))  # too short to be worth a snapshot
    assert len(cache) == 0


def test_snapshots_never_cross_backends(small_backend):
    other = _load("smollm2-135m-q8_0.gguf")
    try:
        cache = PrefixCache(lambda: 64 << 20)
        a = small_backend.tokenize(A)
        small_backend.eval(a, all_logits=False)
        cache.prepare(small_backend, small_backend.tokenize(B))
        assert len(cache) == 1
        assert cache.prepare(other, a) == 0  # the target's snapshot is not the draft's
        cache.forget([other])
        assert len(cache) == 0
    finally:
        other.close()


def test_slots_share_their_prefixes_without_a_prefix_cache():
    """With no prefix cache, a conversation the lead slot drops is parked in an empty slot and
    copied back when it returns; a prompt another slot holds is copied in, not prefilled. The
    copied KV gives the exact greedy continuation, and a busy slot is never written."""
    be = _load("smollm2-135m-f32.gguf", n_seq=3)
    try:
        lead, other, spare = be.slots
        a, b = be.tokenize(A), be.tokenize(B)
        ref_a = greedy(lead, a)
        a_kv = list(lead.tokens)
        lead.reset()
        ref_b = greedy(lead, b)
        lead.reset()

        greedy(lead, a)  # the lead holds A's conversation
        # B arrives on the lead: A is parked in the emptier free slot, nothing is copied in.
        assert share_slot_prefix(lead, be.slots, [other, spare], b, park=True) == 0
        assert other.tokens == a_kv and spare.tokens == []
        assert greedy(lead, b) == ref_b
        # A comes back: its KV is copied from where it was parked, and continues exactly.
        follow_up = a_kv + be.tokenize(" And then?", add_bos=False)
        assert share_slot_prefix(lead, be.slots, [spare], follow_up, park=False) == len(a_kv)
        assert lead.tokens == a_kv and spare.tokens == []  # nothing parked: park off
        lead.truncate(len(a) - 1)
        assert greedy(lead, a) == ref_a
        # Without a free slot to park in, the lead's KV is not put anywhere.
        lead.reset()
        greedy(lead, b)
        assert share_slot_prefix(lead, be.slots, [], a, park=True) == len(a)
        assert spare.tokens == []
    finally:
        be.close()


def test_a_short_shared_prefix_is_not_copied():
    """A copy must beat what the slot holds by MIN_GAIN_TOKENS."""
    be = _load("smollm2-135m-f32.gguf", n_seq=2)
    try:
        lead, other = be.slots
        a = be.tokenize(A)
        greedy(other, a)
        few = a[: MIN_GAIN_TOKENS - 1] + be.tokenize(B, add_bos=False)
        assert share_slot_prefix(lead, be.slots, [lead], few, park=False) == 0
        assert lead.tokens == []
    finally:
        be.close()
