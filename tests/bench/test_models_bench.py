"""`memspec bench models`: the trace it replays, and one short real run of both policies on
two small models (Gemma 3 270M as the default target, SmolLM2 for chat)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launcher import ROOT, require_gemma

from memspec_lab.bench.models import Workload, make_alternating, make_trace


@pytest.mark.models
def test_trace_is_seeded_poisson_with_bursts():
    a = make_trace(30, rate=0.5, code_share=0.5, burst_every=6, burst=2, seed=1)
    assert a == make_trace(30, rate=0.5, code_share=0.5, burst_every=6, burst=2, seed=1)
    assert len(a) == 30 and {x.role for x in a} == {"code", "chat"}
    assert all(x.at_s <= y.at_s for x, y in zip(a, a[1:], strict=False))
    same_instant = sum(x.at_s == y.at_s for x, y in zip(a, a[1:], strict=False))
    assert same_instant >= 4  # the bursts
    assert a != make_trace(30, rate=0.5, code_share=0.5, burst_every=6, burst=2, seed=2)


@pytest.mark.models  # its prompts are the testbed's (HumanEval, MT-Bench): --quick fetches none
def test_alternating_clients_switch_model_every_request():
    clients = make_alternating(4, 3)
    assert [len(c) for c in clients] == [3, 3, 3, 3]
    for i, mine in enumerate(clients):
        roles = [a.role for a in mine]
        assert roles == [("code", "chat")[(i + j) % 2] for j in range(3)]
    assert len(Workload(clients=clients).arrivals()) == 12


@pytest.mark.slow
def test_both_policies_serve_the_same_answers(tmp_path):
    require_gemma()
    out = tmp_path / "models.json"
    cmd = [sys.executable, "-m", "memspec.cli", "bench", "models", "--coder", "gemma3:270m"]
    cmd += ["--chat", "smollm2:135m", "--requests", "5", "--rate", "2", "--max-tokens", "4"]
    cmd += ["--n-threads", "1", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=900, capture_output=True)
    rep = json.loads(out.read_text())
    versus = rep["memspec_vs_lru"]
    assert versus["answers_identical"] == versus["answers_compared"] == 5
    for policy in ("memspec", "lru"):
        run = rep["runs"][policy]
        assert run["failed"] == [] and run["requests_per_s"] > 0
        assert run["peak_modelled_bytes"] <= rep["budget_bytes"]
        assert sum(run["loads"].values()) >= 2  # the budget holds one: the chat model loaded
    assert versus["loads"][0] <= versus["loads"][1]
