"""Two models under a budget that holds one, on the real daemon: SmolLM2 (the testbed's default
target) and Gemma 3 270M. What tests/server/test_models.py and test_model_faults.py share: the
budget, the question, each model's answer alone, and the requests they send.
"""

from __future__ import annotations

import httpx
from launcher import MODEL, plain_answer, require_gemma

GEMMA = "gemma3:270m"
BUDGET = "900MiB"  # SmolLM2 F32 needs ~608 MiB at n_ctx 1024, Gemma ~413 MiB: one at a time
QUESTION = "Name three colours."
TOKENS = 12


def answers_alone() -> dict[str, str]:
    """Each model's greedy answer, plain, with nothing else loaded (in this process): what the
    daemon must answer whichever model was resident before."""
    return {
        MODEL: plain_answer(None, QUESTION, TOKENS),
        GEMMA: plain_answer(require_gemma(), QUESTION, TOKENS),
    }


def chat(
    d, model: str | None, max_tokens: int = TOKENS, timeout: float = 300, **extra
) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    if model is not None:
        body["model"] = model
    return httpx.post(d.url + "/v1/chat/completions", json=body, timeout=timeout)


def status(d) -> dict:
    return httpx.get(d.url + "/admin/status", timeout=60).json()
