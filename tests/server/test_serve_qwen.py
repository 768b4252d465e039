"""The daemon end to end on the real pair: `memspec serve` on Qwen2.5-Coder-1.5B with its
default pool (the whole family the build made: the 0.5B sibling, prompt lookup, datastores),
through the official `openai` client. One daemon for the module; short answers (a step of the
1.5B is ~60-120 ms here).

Every answer equals plain decoding's; a completion ends at `<|endoftext|>`; under a budget that
cannot hold the sibling beside the target the daemon stays within it and decodes without it
(never waiting on a load it did not ask for); with room again a request that wants the sibling
gets it, and status and /metrics carry each draft's predicted value."""

from __future__ import annotations

import httpx
import openai
import pytest
from launcher import ADMIN_KEY, API_KEY, QWEN_SIBLING, require_qwen, running
from prometheus_client.parser import text_string_to_metric_families

MAX_TOKENS = 16
MODEL = "qwen2.5-coder-1.5b-instruct"
CODE = "Write a Python function is_even(n) that returns whether n is even."
ENDS_SOON = (
    'def add(a, b):\n    return a + b\n\n\nif __name__ == "__main__":\n    print(add(1, 2))\n'
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    target = require_qwen()
    # The whole family (no drafts setting); both cores, as a user's daemon would have.
    settings = {"target": str(target), "drafts": None, "budget": "2GiB", "n_threads": 2}
    tmp = tmp_path_factory.mktemp("qwen")
    with running(tmp, settings=settings, keys=True, ready_s=900) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def admin(daemon):
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=daemon.url, timeout=600, headers=headers) as c:
        yield c


def chat(client, draft: str, policy: str | None = None):
    extra = {"draft": draft} | ({"policy": policy} if policy else {})
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": CODE}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
    )


@pytest.fixture(scope="module")
def plain(client):
    r = chat(client, "none")
    assert r.model_extra["memspec"]["proposed"] == 0
    return r.choices[0].message.content


def drafts(admin) -> dict[str, dict]:
    return {d["id"]: d for d in admin.get("/admin/status").json()["drafts"]}


def test_the_default_pool_is_the_family(client, admin):
    assert client.models.list().data[0].id == "qwen2.5-coder:1.5b"  # Ollama's name for it
    rows = drafts(admin)
    assert {QWEN_SIBLING, "prompt-lookup", "datastore-ci"} <= set(rows)
    assert rows[QWEN_SIBLING]["resident"], rows[QWEN_SIBLING]  # 2 GiB holds both


@pytest.mark.parametrize(
    ("draft", "policy"),
    [("auto", None), ("auto", f"fixed:{QWEN_SIBLING}"), ("auto", "fixed:datastore-ci")],
)
def test_greedy_answers_equal_plain_decoding(client, plain, draft, policy):
    r = chat(client, draft, policy)
    assert r.choices[0].message.content == plain, (draft, policy)
    if policy == f"fixed:{QWEN_SIBLING}":  # drafts every round: speculation really ran
        assert r.model_extra["memspec"]["proposed"] > 0


def test_a_completion_ends_at_endoftext(client):
    r = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=ENDS_SOON,
        max_tokens=24,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert r.usage.completion_tokens < 24


def test_a_budget_without_room_for_the_sibling_then_room_again(client, admin, plain):
    r = admin.post("/admin/tune", json={"budget": "1.5GiB"})
    assert r.status_code == 200, r.text
    status = admin.get("/admin/status").json()
    assert status["used_bytes"]["modelled"] <= status["budget_bytes"]
    assert not drafts(admin)[QWEN_SIBLING]["resident"]
    r = chat(client, "auto")
    assert r.choices[0].message.content == plain
    assert r.model_extra["memspec"]["stall_s"] == 0.0  # no load it did not ask for
    assert QWEN_SIBLING not in r.model_extra["memspec"]["drafts_used"]

    assert admin.post("/admin/tune", json={"budget": "2GiB"}).status_code == 200
    # Room again: a request naming the sibling loads it (a load it asked for) and drafts with it.
    r = chat(client, "auto", f"fixed:{QWEN_SIBLING}")
    assert r.choices[0].message.content == plain
    assert r.model_extra["memspec"]["proposed"] > 0
    row = drafts(admin)[QWEN_SIBLING]
    assert row["resident"] and row["value"] >= 0, row
    status = admin.get("/admin/status").json()
    assert status["used_bytes"]["modelled"] <= status["budget_bytes"]
    text = admin.get("/metrics").text
    values = {
        s.labels["draft"]
        for fam in text_string_to_metric_families(text)
        if fam.name == "memspec_draft_predicted_value"
        for s in fam.samples
    }
    assert {QWEN_SIBLING, "datastore-ci", "prompt-lookup"} <= values, values
