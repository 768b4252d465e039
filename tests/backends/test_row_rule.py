"""The row rule (backends/llama_cpp.py): a target whose multi-row kernels (repacked weights'
gemm, ggml's tiled K-quant matmul) make the batch matter gives every position the kernels a
cold plain decoding gives it, whatever its cache held before, how its prompt was chunked, and
what shared its passes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.backends.llama_cpp import BLOCK_ROWS, GEMM_ROWS, TILED_MIN_ROWS, prompt_pass_start

ROW_PASS = GEMM_ROWS - 1  # the rule's generation passes on repacked weights
CHUNK = 16  # n_batch, small enough that prompts here come in several chunks


class KernelMap:
    """Which kernels llama.cpp gives each cached position: a pass of n rows runs its first
    n - n % 4 through the repacked gemm in groups from its first row and the rest through gemv,
    and all of them through the tiled matmul if n >= 8, else through vec_dot."""

    def __init__(self) -> None:
        self.kernels: list[tuple[str, str]] = []
        self.block_prefix = 0

    def run_pass(self, n: int) -> None:
        gemm = n - n % GEMM_ROWS
        tiled = "tiled" if n >= TILED_MIN_ROWS else "vec_dot"
        self.kernels += [("gemm", tiled)] * gemm + [("gemv", tiled)] * (n - gemm)

    def prompt(self, n: int) -> None:  # what _prompt_blocks and then _forward_rows do
        end = len(self.kernels) + n
        body = end - end % BLOCK_ROWS
        start = prompt_pass_start(len(self.kernels), end, self.block_prefix)
        self.truncate(start)
        for i in range(start, body, CHUNK):
            self.run_pass(min(CHUNK, body - i))
            self.block_prefix = len(self.kernels)
        self.generate(end - len(self.kernels))

    def generate(self, n: int) -> None:  # what _forward_rows does: passes of < 4 rows
        for i in range(0, n, ROW_PASS):
            self.run_pass(min(ROW_PASS, n - i))

    def truncate(self, n: int) -> None:
        del self.kernels[n:]
        self.block_prefix = min(self.block_prefix, n)

    def reuse(self, n: int, end: int) -> int:  # what _reusable_seq does
        kept = prompt_pass_start(n, end, min(self.block_prefix, n))
        self.truncate(kept)
        return kept


def cold(end: int) -> list[tuple[str, str]]:
    body = end - end % BLOCK_ROWS
    return [("gemm", "tiled")] * body + [("gemv", "vec_dot")] * (end - body)


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
                seq.prompt(rng.randint(1, 60))
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


@pytest.fixture(scope="module", params=["repacked", "stored", "repacked+features"])
def ruled(request):
    """Gemma 3 270M Q4_K_M under the row rule, two sequence slots: repacked (gemm and, for its
    Q6_K weights, the tiled matmul), as stored (the tiled matmul for all of them), and
    repacked with features on (a head's target: embeddings mode on its generation passes)."""
    from launcher import require_gemma

    repack = request.param != "stored"
    options = BackendOptions(
        n_ctx=512,
        n_threads=1,
        n_seq=2,
        weight_repack=repack,
        batch_invariant=True,
        features=request.param.endswith("features"),
    )
    be = load_backend(require_gemma(), options)
    described = be.describe()
    assert described["weight_repack"] == repack and described["tiled_matmul"]
    assert described["batch_invariant"]
    yield be
    be.close()


TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nThe three primary colors are red, yellow and blue; mixed two at a time, "
    "they make the secondary colors orange, green and purple. A prism splits white light."
)


def _rows(be, tokens):
    return np.concatenate([be.eval([t]).copy() for t in tokens])


def test_cached_chunked_and_batched_prompts_give_cold_logits(ruled):
    be = ruled
    toks = be.tokenize(TEXT)
    assert len(toks) >= 70
    prompt, gen = toks[:41], toks[41:57]

    def reference() -> np.ndarray:
        be.reset()
        be.eval(prompt, all_logits=False)
        return _rows(be, gen)

    ref = reference()
    # Verification passes of every size (from 8 rows on, ones the tiled matmul would take).
    for k in (2, 3, 4, 5, 8, 9):
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
    assert snapshot is not None and snapshot.block_prefix == len(prompt) - len(prompt) % 8
    slot1.kv_restore(snapshot)
    assert np.array_equal(_rows(slot1, gen), ref), "restored snapshot"


def test_a_lone_generation_pass_is_read_in_place(ruled):
    """Greedy decoding reads each row's argmax off llama.cpp's buffer: a pass within the rule's
    row limit (3 rows repacked, 7 as stored) is one decode and comes back as a read-only view,
    not a copy (a features target's rows are a copy)."""
    be = ruled
    row_pass = GEMM_ROWS - 1 if be.describe()["weight_repack"] else TILED_MIN_ROWS - 1
    be.reset()
    toks = be.tokenize(TEXT)
    be.eval(toks[:20], all_logits=False)
    view = be.eval(toks[20 : 20 + row_pass], copy=False)
    if be.options.features:  # its rows picked out of all that embeddings mode outputs
        assert view.flags.writeable
    else:
        assert not view.flags.writeable and not view.flags.owndata
    at = 20 + row_pass
    longer = be.eval(toks[at : at + row_pass + 2], copy=False)  # two decodes: copied out
    assert longer.shape[0] == row_pass + 2 and longer.flags.writeable
    assert not np.shares_memory(longer, view)
