"""A synthetic trace shaped like the testbed pool: which draft wins depends on the category."""

from __future__ import annotations

import random

import pytest

from memspec_lab.sim.traces import DraftPositions, RunRecord, Trace, TraceRequest

K_MAX = 8
# Per category, per-token acceptance of each model draft, and how often the answer quotes the
# prompt (prompt lookup's chance of a long match).
CATEGORIES = {
    "extraction": ({"q8_0": 0.85, "q4_0": 0.6, "q2_k": 0.4}, 0.7),
    "writing": ({"q8_0": 0.9, "q4_0": 0.85, "q2_k": 0.5}, 0.05),
    "coding": ({"q8_0": 0.7, "q4_0": 0.3, "q2_k": 0.2}, 0.2),
    "roleplay": ({"q8_0": 0.5, "q4_0": 0.2, "q2_k": 0.1}, 0.05),
}


def runs_from(match: list[bool], cap: int) -> list[int]:
    run, streak = [0] * len(match), 0
    for i in range(len(match) - 1, -1, -1):
        streak = streak + 1 if match[i] else 0
        run[i] = min(streak, cap)
    return run


def make_trace(per_category: int = 3, out_len: int = 96, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    header = {
        "version": 1,
        "settings": {"k_max": K_MAX, "max_tokens": out_len, "target": "synthetic"},
        "drafts": {
            "prompt-lookup": {"kind": "prompt_lookup", "bytes": 0},
            "q8_0": {"kind": "model", "bytes": 192_000_000},
            "q4_0": {"kind": "model", "bytes": 139_000_000},
            "q2_k": {"kind": "model", "bytes": 135_000_000},
        },
        "costs": {
            "verify_s": [0.02 + 0.0025 * b for b in range(K_MAX + 1)],
            "draft_s": {"q8_0": 0.011, "q4_0": 0.008, "q2_k": 0.0065},
            "draft_overhead_s": {"prompt-lookup": 5e-5},
        },
    }
    reqs = []
    qid = 0
    for cat, (alphas, quote) in CATEGORIES.items():
        base = 1000 + 1000 * len(reqs)
        for _ in range(per_category):
            qid += 1
            for turn in (1, 2):
                prompt = [rng.randrange(base, base + 200) for _ in range(60 * turn)]
                drafts = {}
                for d, a in alphas.items():
                    match = [rng.random() < a for _ in range(out_len)]
                    drafts[d] = DraftPositions(
                        [min(K_MAX, out_len - i) for i in range(out_len)],
                        runs_from(match, K_MAX),
                    )
                length, run, keys = [], [], []
                for i in range(out_len):
                    if rng.random() < quote:
                        n = min(K_MAX, out_len - i)
                        length.append(n)
                        run.append(min(n, rng.randrange(2, K_MAX + 1)))
                        keys.append("n3")
                    else:
                        length.append(0)
                        run.append(0)
                        keys.append("")
                drafts["prompt-lookup"] = DraftPositions(length, run, keys)
                reqs.append(
                    TraceRequest(
                        id=f"q{qid}-t{turn}",
                        question_id=qid,
                        category=cat,
                        turn=turn,
                        prompt=prompt,
                        output=[rng.randrange(100) for _ in range(out_len)],
                        drafts=drafts,
                        plain=RunRecord(None, 0, 2.0, 0.05, out_len, True),
                        text=f"{cat} question",
                    )
                )
    return Trace(header, reqs)


@pytest.fixture(scope="session")
def synthetic_trace() -> Trace:
    return make_trace()
