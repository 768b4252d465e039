"""The row rule (backends/llama_cpp.py): a target with llama.cpp's repacked weights gives
every position the kernel a cold plain decoding gives it, whatever its cache held before, how
its prompt was chunked, and what shared its passes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.backends.llama_cpp import GEMM_ROWS, prompt_pass_start


class KernelMap:
    """Which kernel llama.cpp's repacked matmul gives each cached position: a pass of n rows
    runs its first n - n % 4 through gemm in groups from its first row, the rest through gemv."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self.gemm_prefix = 0

    def run_pass(self, n: int) -> None:
        gemm = n - n % GEMM_ROWS
        self.kernels += ["gemm"] * gemm + ["gemv"] * (n - gemm)

    def prompt(self, n: int) -> None:  # what _forward_prompt does
        end = len(self.kernels) + n
        start = prompt_pass_start(len(self.kernels), end, self.gemm_prefix)
        self.truncate(start)
        self.run_pass(end - start)
        self.gemm_prefix = end - end % GEMM_ROWS

    def generate(self, n: int) -> None:  # what _forward_rows does: passes of < 4 rows
        for _ in range(n):
            self.run_pass(1)

    def truncate(self, n: int) -> None:
        del self.kernels[n:]
        self.gemm_prefix = min(self.gemm_prefix, n)

    def reuse(self, n: int, end: int) -> int:  # what _reusable_seq does
        kept = prompt_pass_start(n, end, min(self.gemm_prefix, n))
        self.truncate(kept)
        return kept


def cold(end: int) -> list[str]:
    body = end - end % GEMM_ROWS
    return ["gemm"] * body + ["gemv"] * (end - body)


def test_every_prompt_pass_leaves_the_kernels_of_a_cold_one():
    """Random histories of prompts (whole, chunked, after a reuse), generations and rollbacks:
    after every prompt pass the cache's kernels are those of one cold pass over it."""
    rng = random.Random(7)
    recomputed = 0
    for _ in range(3000):
        seq = KernelMap()
        for _ in range(rng.randint(1, 8)):
            op = rng.choice(["prompt", "chunks", "generate", "truncate", "reuse"])
            if op == "prompt":
                seq.prompt(rng.randint(1, 40))
            elif op == "chunks":
                for _ in range(rng.randint(2, 5)):
                    seq.prompt(rng.randint(1, 9))
            elif op == "generate":
                seq.generate(rng.randint(1, 12))
            elif op == "truncate":
                seq.truncate(rng.randint(0, len(seq.kernels)))
            else:
                end = rng.randint(1, len(seq.kernels) + 20)
                n = rng.randint(0, min(end, len(seq.kernels)))
                kept = seq.reuse(n, end)
                assert kept <= n
                recomputed += n - kept
                if kept < end:
                    seq.prompt(end - kept)
            if op in ("prompt", "chunks", "reuse") and seq.kernels:
                assert seq.kernels == cold(len(seq.kernels)), op
    assert recomputed > 0  # the histories did need positions computed again


@pytest.fixture(scope="module")
def repacked():
    """Gemma 3 270M Q4_K_M, repacked, under the row rule, two sequence slots."""
    from launcher import require_gemma

    options = BackendOptions(
        n_ctx=512, n_threads=1, n_seq=2, weight_repack=True, batch_invariant=True
    )
    be = load_backend(require_gemma(), options)
    assert be.describe()["weight_repack"] and be.describe()["batch_invariant"]
    yield be
    be.close()


TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nThe three primary colors are red, yellow and blue; mixed two at a time, "
    "they make the secondary colors orange, green and purple. A prism splits white light."
)


def _rows(be, tokens):
    return np.concatenate([be.eval([t]).copy() for t in tokens])


def test_cached_chunked_and_batched_prompts_give_cold_logits(repacked):
    be = repacked
    toks = be.tokenize(TEXT)
    assert len(toks) >= 70
    prompt, gen = toks[:41], toks[41:57]

    def reference() -> np.ndarray:
        be.reset()
        be.eval(prompt, all_logits=False)
        return _rows(be, gen)

    ref = reference()
    # Verification passes of every size.
    for k in (2, 3, 4, 5, 8):
        be.truncate(len(prompt))
        got = np.concatenate([be.eval(gen[i : i + k]) for i in range(0, len(gen), k)])
        assert np.array_equal(got, ref), f"verify k={k}"
    # A cache that held a longer prompt and its generation, cut at several places.
    be.reset()
    be.eval(toks[:60], all_logits=False)
    be.eval(toks[60:66])
    for cut in (66, 41, 39, 38, 17, 0):
        be.truncate(cut)
        kept = be.reuse_prefix(prompt)
        assert kept <= min(cut, len(prompt))
        if kept < len(prompt):
            be.eval(prompt[kept:], all_logits=False)
        assert np.array_equal(_rows(be, gen), ref), f"cache cut at {cut}, kept {kept}"
        be.truncate(len(prompt) + len(gen))
    # A prompt fed in chunks (a request joining a batch).
    be.reset()
    for i in range(0, len(prompt), 7):
        be.eval(prompt[i : i + 7], all_logits=False)
    assert np.array_equal(_rows(be, gen), ref), "chunked prompt"
    # One pass with a verification on one slot and a prompt on the other.
    slot0, slot1 = be.slots
    be.reset()
    slot1.reset()
    be.eval(prompt, all_logits=False)
    out = be.eval_many([(slot0, gen[:5], 5), (slot1, prompt, 0)])
    assert np.array_equal(out[0], ref[:5])
    assert np.array_equal(_rows(slot1, gen), ref), "prompt beside a verification"
    # A snapshot restored into the other slot.
    be.reset()
    be.eval(prompt, all_logits=False)
    snapshot = be.kv_snapshot()
    assert snapshot is not None and snapshot.gemm_prefix == len(prompt) - len(prompt) % 4
    slot1.kv_restore(snapshot)
    assert np.array_equal(_rows(slot1, gen), ref), "restored snapshot"


def test_a_lone_generation_pass_is_read_in_place(repacked):
    """Greedy decoding reads each row's argmax off llama.cpp's buffer: a pass of fewer than 4
    rows is one decode and comes back as a read-only view, not a copy."""
    be = repacked
    be.reset()
    toks = be.tokenize(TEXT)
    be.eval(toks[:20], all_logits=False)
    view = be.eval(toks[20:23], copy=False)
    assert not view.flags.writeable and not view.flags.owndata
    longer = be.eval(toks[23:28], copy=False)  # two decodes: copied out of the buffer
    assert longer.shape[0] == 5 and longer.flags.writeable
    assert not np.shares_memory(longer, view)
