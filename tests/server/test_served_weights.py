"""One copy of a model's weights for both roles, on the real daemon (backends.shared_weights,
memspec.targets): Qwen2.5-Coder 1.5B serves with its 0.5B sibling as its draft, and the 0.5B is
asked for by name. The 0.5B's load takes the draft's weights: the modelled bytes and the
daemon's measured RSS grow by its context only, and both answers equal each model's own plain
decoding served alone. When the 0.5B leaves, the draft pays for the weights again.

Bounded for CI: short answers at n_ctx 512; the 1.5B's calibration is cached by the Qwen pair's
other tests (tests/engine/test_qwen_pair.py) and otherwise takes a minute or two.
"""

from __future__ import annotations

import httpx
import psutil
import pytest
from launcher import QWEN_SIBLING, plain_answer, require_qwen, running

from memspec.memory.gguf_info import read_shape
from memspec.package_index import QWEN_SIBLING_FILE
from memspec.paths import models_dir

# Slow tier: the daemon end to end on the 1.5B pair (minutes of loads here). Sharing one load's
# weights, decoding as if alone and the context-only charge are checked in the default tier on
# the backends (tests/backends/test_shared_weights.py).
pytestmark = pytest.mark.slow

QUESTION = "Write a Python function that adds two numbers."
TOKENS = 12
N_CTX = 512


@pytest.fixture(scope="module")
def alone() -> dict[str, str]:
    """Each model's greedy answer, plain, served alone (in this process)."""
    return {
        "coder": plain_answer(require_qwen(), QUESTION, TOKENS, N_CTX),
        "small": plain_answer(models_dir() / QWEN_SIBLING_FILE, QUESTION, TOKENS, N_CTX),
    }


def chat(url: str, model: str, **extra) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": TOKENS,
        "temperature": 0,
        **extra,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=600)


def models(url: str) -> dict[str, dict]:
    rows = httpx.get(url + "/admin/status", timeout=60).json()["models"]
    return {m["name"]: m for m in rows}


def test_the_sibling_served_by_name_shares_the_drafts_weights(alone, tmp_path):
    target = require_qwen()
    settings = {
        "target": str(target),
        "drafts": [QWEN_SIBLING],  # preloaded: resident before the 0.5B is asked for
        "budget": "3GiB",
        "n_ctx": N_CTX,
        "parallel": 1,
    }
    with running(tmp_path, "lookup", settings=settings, ready_s=900) as d:
        ids = [m["id"] for m in httpx.get(d.url + "/v1/models").json()["data"]]
        coder = ids[0]
        small = next(i for i in ids if "0.5b" in i)
        proc = psutil.Process(d.proc.pid)

        r = chat(d.url, coder, draft=QWEN_SIBLING)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == alone["coder"]
        before = models(d.url)
        assert [n for n, m in before.items() if m["resident"]] == [coder]
        rss_before = proc.memory_info().rss

        r = chat(d.url, small)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == alone["small"]
        after = models(d.url)
        rss_after = proc.memory_info().rss
        assert after[small]["resident"] and after[coder]["resident"]

        # The weights, as llama.cpp loads them (the file less its header and vocabulary).
        weights = read_shape(models_dir() / QWEN_SIBLING_FILE).weight_bytes
        grown = sum(m["bytes"] for m in after.values()) - sum(m["bytes"] for m in before.values())
        grown_rss = rss_after - rss_before
        print(
            f"0.5B weights {weights / 2**20:.0f} MiB; served by name beside its draft role: "
            f"modelled +{grown / 2**20:.1f} MiB, RSS +{grown_rss / 2**20:.1f} MiB"
        )
        assert 0 < grown < weights / 4  # its KV and buffers: the weights are counted once
        assert grown_rss < weights / 2  # and loaded once
        assert sum(m["bytes"] for m in after.values()) <= 3 * 2**30

        # The 1.5B's answer is still its own, its sibling resident on the shared weights and
        # charged its context only. (Whether a round drafts is the decision rule's call: its
        # bit-exactness on shared weights is tests/backends/test_shared_weights.py's.)
        r = chat(d.url, coder, draft=QWEN_SIBLING)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == alone["coder"]
        drafts = {x["id"]: x for x in httpx.get(d.url + "/admin/drafts").json()["drafts"]}
        assert drafts[QWEN_SIBLING]["resident"]
        assert 0 < drafts[QWEN_SIBLING]["bytes"] < weights / 4

        # The 0.5B leaves (keep_alive 0): the draft pays for the weights again.
        r = httpx.post(d.url + "/api/generate", json={"model": small, "keep_alive": 0}, timeout=120)
        assert r.status_code == 200, r.text
        left = models(d.url)
        assert not left[small]["resident"]
        assert left[coder]["bytes"] == before[coder]["bytes"]
        drafts = {x["id"]: x for x in httpx.get(d.url + "/admin/drafts").json()["drafts"]}
        assert drafts[QWEN_SIBLING]["resident"] and drafts[QWEN_SIBLING]["bytes"] > weights
