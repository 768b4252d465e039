"""`memspec bench runtime` on the real target (one prompt, few tokens) and over its stub: the
report's shape, and that a split's parts add up to no more than the whole."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memspec.engine.policy import FixedPolicy
from memspec.engine.speculative import speculative_generate
from memspec.engine.types import SamplingParams
from memspec_lab.bench.runtime_cost import (
    POOL_CONFIG,
    SPLIT,
    STUB_CONFIGS,
    free_pool,
    run_runtime_bench,
)
from memspec_lab.stub_backend import StubBackend

TOLERANCE_MS = 1e-3  # the split's cells are rounded to 1e-4 ms each


def check_split(s: dict) -> None:
    for unit in ("token", "round"):  # the same parts, per generated token and per round
        parts = s[f"split_ms_per_{unit}"]
        assert set(parts) == set(SPLIT)
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) <= s[f"ms_per_{unit}"] + TOLERANCE_MS
    parts = s["split_ms_per_token"]
    detail = s["engine_detail_ms_per_token"]
    assert sum(detail.values()) <= parts["engine"] + TOLERANCE_MS
    # Our own cost is everything but the model's step.
    assert s["own_ms_per_token"] == pytest.approx(
        s["ms_per_token"] - parts["model"], abs=TOLERANCE_MS
    )
    assert s["tokens"] > 0 and s["rounds"] > 0


def test_bench_runtime_report(tmp_path, settings):
    out = tmp_path / "runtime.json"
    report = run_runtime_bench(
        settings.model_copy(deep=True),
        out=str(out),
        prompts=1,
        max_tokens=8,
        peer_server=False,
        stub_tokens=24,
        sweep_mib=1,
        repeat=2,
    )
    assert json.loads(out.read_text()) == report
    real = report["real"]
    assert set(real["systems"]) == {"memspec", "memspec stream"}
    assert real["peer_server_skipped"].startswith("not asked for")
    for name, s in real["systems"].items():
        check_split(s)
        assert s["identical_to_plain"], name
        assert s["tokens"] == 16 and s["prefill"]["tokens"] > 0  # the prompt twice over
        assert len(s["runs"]) == 2
        assert s["split_ms_per_token"]["model"] > 0  # llama.cpp's decode, from decode_s
    # Only the streamed config hands text to a stream.
    assert real["systems"]["memspec"]["split_ms_per_token"]["stream"] == 0
    assert real["systems"]["memspec stream"]["split_ms_per_token"]["stream"] > 0

    stub = report["stub"]
    assert stub["goal_ms"] == 0.3
    assert "prompt-lookup" in stub["free_pool"]
    assert set(stub["free_pool"]) <= set(free_pool(settings))
    for mode in ("warm", "cold"):
        configs = stub[mode]["configs"]
        assert list(configs) == [name for name, *_ in STUB_CONFIGS]
        for name, s in configs.items():
            check_split(s)
            assert s["continues_cycle"], (mode, name)
            if name == POOL_CONFIG:
                # The daemon's own rule among the free drafts: each peeked every round.
                assert s["engine_detail_ms_per_token"]["choose"] > 0, mode
                assert s["tokens_per_round"] >= 1.0, mode
            elif name.startswith("prompt-lookup") and "adaptive" not in name:
                assert s["tokens_per_round"] > 2, (mode, name)  # it finds the cycle: k = 4
            elif name.startswith("prompt-lookup"):
                # The rule's k follows the stub's measured step, microseconds whose noise under
                # load can make drafting look dear (seen once in a loaded suite): k is its call.
                assert s["tokens_per_round"] >= 1.0, (mode, name)
            else:
                assert s["tokens_per_round"] == 1.0


def test_stub_rows_are_views_of_one_table(tmp_path):
    """A round of consecutive cycle tokens reads its rows in place, as llama.cpp's buffer is
    read; greedy decoding walks the cycle on from any token of it."""
    stub = StubBackend(tmp_path / "stub.gguf", n_vocab=4096, n_ctx=256)
    prompt = [1] + stub.cycle * 2
    stub.eval(prompt[:-1], all_logits=False)
    rows = stub.eval(prompt[-1:] + stub.cycle[:3], copy=False)
    assert np.shares_memory(rows, stub.table)
    assert rows.argmax(axis=1).tolist() == stub.cycle[:4]
    stub.reset()
    gen = speculative_generate(stub, prompt, SamplingParams(max_tokens=40), FixedPolicy(None, 0))
    assert gen.token_ids == (stub.cycle * 3)[:40]


def test_llama_servers_row_is_per_decode_step():
    """llama-server's first token comes from the prompt's pass: predicted_ms spans one decode
    step fewer than it has tokens, as its own predicted_per_token_ms counts."""
    from memspec_lab.bench.runtime_cost import _peer_summary

    rows = [
        {"id": "a", "token_ids": [1, 2], "prompt_n": 10, "prompt_ms": 30.0,
         "predicted_n": 65, "predicted_ms": 640.0},
        {"id": "b", "token_ids": [3], "prompt_n": 20, "prompt_ms": 50.0,
         "predicted_n": 33, "predicted_ms": 320.0},
    ]  # fmt: skip
    s = _peer_summary(rows, {"a": [1, 2], "b": [4]})
    assert s["rounds"] == 96 and s["ms_per_round"] == 10.0
    assert s["prefill"] == {"tokens": 30, "ms_per_token": round(80.0 / 30, 4)}
    assert s["tokens"] == 3 and not s["identical_to_plain"]


def test_memspec_against_llama_server_per_step_and_per_prompt():
    """The ratios are speeds (above 1: memspec faster), over the run and as the median of the
    back-to-back pairs, so one pair hit by a burst of load does not move the median."""
    from memspec_lab.bench.runtime_cost import _versus

    def ours(step_ms: float, prompt_ms_per_token: float) -> dict:
        rounds = 10
        return {
            "id": "p", "tokens": rounds, "rounds": rounds, "prompt_tokens": 21,
            "prefill_tokens": 20, "decode_s": 0.0, "forward_s": 0.0,
            "elapsed_s": (rounds * step_ms + 20 * prompt_ms_per_token) / 1e3,
            "phases": {"prefill": 20 * prompt_ms_per_token / 1e3},
        }  # fmt: skip

    def theirs(step_ms: float, prompt_ms_per_token: float) -> dict:
        return {"id": "p", "prompt_n": 20, "prompt_ms": 20 * prompt_ms_per_token, "predicted_n": 11,
                "predicted_ms": 10 * step_ms, "token_ids": list(range(10))}  # fmt: skip

    # Pairs of (ours, theirs): memspec 1.25x faster per step twice, then a pair 4x slower.
    vs = _versus(
        [ours(8.0, 4.0), ours(8.0, 4.0), ours(40.0, 4.0)],
        [theirs(10.0, 5.0), theirs(10.0, 5.0), theirs(10.0, 5.0)],
    )
    assert vs["pairs"] == 3
    assert vs["decode_step_median_of_prompts"] == 1.25
    assert vs["prompt_token_median_of_prompts"] == 1.25 and vs["prompt_token"] == 1.25
    assert vs["decode_step"] == round(10.0 / (56.0 / 3), 3)  # the run's totals: the burst
    lo, hi = vs["decode_step_median_ci95"]
    assert 0.25 <= lo <= 1.25 <= hi == 1.25  # the burst pair drawn twice pulls it down
    assert vs["prompt_token_median_ci95"] == [1.25, 1.25]  # every pair alike
