"""Gemma 3's sliding-window layers with a window-sized cache (KVCache.swa_full off, the
default): five layers in six keep the last 512 tokens plus a batch (1,024 cells), so a long
prompt wraps their cache. Speculation stays lossless through the wrap, and a cached prefix cut
deeper than the window still held is computed again rather than attended to half-gone."""

from __future__ import annotations

import pytest
from launcher import require_gemma

from memspec.backends.llama_cpp import BLOCK_ROWS
from memspec.config import Settings
from memspec.engine.types import SamplingParams
from memspec_lab.bench.edit_workload import load_edit_workload

N_CTX = 4096
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def gemma_runtime():
    from memspec.runtime import Runtime

    settings = Settings.load(target=str(require_gemma()), n_ctx=N_CTX, n_threads=2)
    assert not settings.kv_cache.swa_full
    rt = Runtime(settings, calibrate_costs=False)  # costs alike: `auto` drafts every round
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def long_prompt(gemma_runtime) -> list[int]:
    """A whole-file edit of about 1,700 tokens: past the sliding-window cache's 1,024 cells."""
    (p,) = [p for p in load_edit_workload("edit", 10)[0] if p.id == "edit-heldout-rename-errors"]
    tokens = gemma_runtime.requests.prompt_tokens(messages=[{"role": "user", "content": p.text}])
    assert 1100 < len(tokens) < N_CTX - MAX_TOKENS
    return tokens


def test_the_window_is_what_llama_cpp_keeps(gemma_runtime):
    t = gemma_runtime.target
    layer = t.n_kv_heads * (t.head_dim_k + t.head_dim_v) * 2  # f16, one token
    assert t.n_layers == 18  # 3 attend to the whole context, 15 to 1,024 cells of 4,096
    assert t.kv_bytes_per_token() == layer * (3 * N_CTX + 15 * 1024) // N_CTX
    assert gemma_runtime.target_footprint.kv == t.kv_bytes_per_token() * N_CTX


@pytest.mark.parametrize("draft", ["prompt-lookup", "auto"])
def test_speculation_through_the_wrapped_window_is_plain_decoding(
    gemma_runtime, long_prompt, draft
):
    rt = gemma_runtime
    params = SamplingParams(max_tokens=MAX_TOKENS)
    rt.target.reset()
    plain = rt.generate(long_prompt, params, draft="none").token_ids
    rt.target.reset()
    gen = rt.generate(long_prompt, params, draft=draft, k=8 if draft != "auto" else None)
    assert gen.token_ids == plain
    assert gen.proposed > 0  # it did draft (a copy of the file: long accepted runs)


def test_a_prefix_past_the_held_window_is_computed_again(gemma_runtime, long_prompt):
    rt, t = gemma_runtime, gemma_runtime.target
    short, params = long_prompt[:300], SamplingParams(max_tokens=16)
    t.reset()
    cold = rt.generate(short, params, draft="none").token_ids
    t.reset()
    t.eval(long_prompt, all_logits=False)
    n = len(long_prompt)
    # The newest token's window reaches back 512; the cache's 1,024 cells a little further.
    kept = t.reuse_prefix(long_prompt[: n - 100] + [1, 2, 3])
    assert n - 100 - BLOCK_ROWS < kept <= n - 100  # (the row rule may recompute a few rows)
    warm = rt.generate(short, params, draft="none")  # 300 tokens: their window is gone
    assert warm.cached_tokens == 0 and warm.token_ids == cold
