"""Fill-in-the-middle on Qwen2.5-Coder (a target with FIM tokens), speculation on: `suffix` on
/v1/completions through the official client and llama-server's /infill give the middle plain
decoding gives. (A target without FIM tokens: tests/server/test_errors.py.)"""

from __future__ import annotations

import httpx
import openai
from launcher import API_KEY

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\n\nprint(add(1, 2))\n"
N = 6


def test_fill_in_the_middle(qwen_server):
    client = openai.OpenAI(
        base_url=qwen_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
    )
    model = client.models.list().data[0].id
    texts = {}
    for draft in ("none", "prompt-lookup"):
        r = client.completions.create(
            model=model,
            prompt=PREFIX,
            suffix=SUFFIX,
            max_tokens=N,
            temperature=0,
            extra_body={"draft": draft},
        )
        texts[draft] = r.choices[0].text
    assert texts["prompt-lookup"] == texts["none"]
    assert texts["none"].startswith("return a + b"), texts
    r = httpx.post(
        qwen_server.url + "/infill",
        json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": N, "temperature": 0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == texts["none"] and body["stop"] is True
    assert (
        body["tokens_predicted"] <= N and body["timings"]["predicted_n"] == body["tokens_predicted"]
    )
