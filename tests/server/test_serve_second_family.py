"""The daemon end-to-end on the second family: `memspec serve` on Gemma 3 270M (262k
vocabulary, no chat template in its GGUF) with the pool derived for it, through the official
`openai` client. One daemon for the module."""

from __future__ import annotations

import httpx
import openai
import pytest
from launcher import GEMMA_DRAFTS, require_gemma, running

from memspec.model_id import served_model_id

MAX_TOKENS = 24
QUESTION = "Name three primary colours."
GEMMA_MODEL = "gemma3:270m"


@pytest.fixture(scope="module")
def gemma_daemon(tmp_path_factory):
    target = require_gemma()
    # Never the shared MEMSPEC_TEST_URL daemon: that one serves the testbed target.
    settings = {"target": str(target), "drafts": GEMMA_DRAFTS}  # n_ctx 1024, one thread
    with running(tmp_path_factory.mktemp("gemma"), settings=settings) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(gemma_daemon) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gemma_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def http(gemma_daemon):
    with httpx.Client(base_url=gemma_daemon.url, timeout=300) as c:
        yield c


def chat(client: openai.OpenAI, draft: str, policy: str | None = None, **kw):
    """The question, greedy; `draft` (and `policy`) in the body, as MemSpec's extensions."""
    extra = {"draft": draft} | ({"policy": policy} if policy else {})
    return client.chat.completions.create(
        model=GEMMA_MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
        **kw,
    )


@pytest.fixture(scope="module")
def plain(client):
    """The target's own greedy answer (no draft): what every other answer must equal."""
    r = chat(client, "none")
    assert r.model_extra["memspec"]["proposed"] == 0
    return r


def test_models_lists_gemma(client):
    assert client.models.list().data[0].id == GEMMA_MODEL  # the default target first
    target = require_gemma()
    assert served_model_id(None, target) == GEMMA_MODEL


# (draft, policy): the decision rule may decline a draft that does not pay (q2_k of a 4-bit
# target is about the target's size); fixed:<id> always drafts with it (k >= 1).
CASES = [
    ("auto", None),
    ("q2_k", None),
    ("auto", "fixed:q2_k"),
    ("auto", "fixed:datastore-ci"),
    ("auto", "fixed:prompt-lookup"),
]


@pytest.mark.parametrize(("draft", "policy"), CASES)
def test_greedy_with_drafts_equals_plain_decoding(client, plain, draft, policy):
    r = chat(client, draft, policy)
    assert r.model == GEMMA_MODEL
    assert r.choices[0].message.content == plain.choices[0].message.content, (draft, policy)
    assert r.usage.completion_tokens == plain.usage.completion_tokens
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    ms = r.model_extra["memspec"]
    assert set(ms["drafts_used"]) <= set(GEMMA_DRAFTS), ms
    if policy == "fixed:q2_k":  # a model draft proposes every round: speculation really ran
        assert ms["proposed"] > 0 and set(ms["drafts_used"]) == {"q2_k"}, ms


def test_stream_assembles_to_the_same_text(client, plain):
    chunks = list(chat(client, "auto", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("length", "stop") and all(f is None for f in finals[:-1])
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_a_skipped_recipe_is_refused_and_the_daemon_serves_on(client, plain, http, gemma_daemon):
    """q4_0 is in the testbed pool but the family skipped it (the target is already 4-bit): a
    clean 404 naming the reason, before anything runs."""
    with pytest.raises(openai.NotFoundError) as caught:
        chat(client, "q4_0")
    error = caught.value.body
    assert caught.value.status_code == 404
    assert error["code"] == "draft_not_found" and error["param"] == "draft"
    assert error["message"].startswith("draft 'q4_0' was not built for this target: ")
    assert "the target is already 4.8 bits/weight" in error["message"]
    assert "Traceback" not in error["message"]
    assert http.get("/health").json()["status"] == "ok"
    assert chat(client, "auto").choices[0].message.content == plain.choices[0].message.content
    if gemma_daemon.proc is not None:
        assert gemma_daemon.proc.poll() is None


def test_admin_status_shows_template_and_pool(http):
    status = http.get("/admin/status").json()
    assert status["model"] == GEMMA_MODEL
    assert status["target"] == str(require_gemma())
    # Gemma 3's GGUF ships no template: llama.cpp's built-in for its architecture, no warning.
    assert status["chat_template"] == {"source": "builtin:gemma", "warning": None}
    drafts = {d["id"]: d for d in status["drafts"]}
    for draft in GEMMA_DRAFTS:  # the family's drafts: compatible and preloaded
        assert drafts[draft]["compatible"] is True and drafts[draft]["resident"], drafts[draft]
    assert drafts["q2_k"]["kind"] == "model" and drafts["q2_k"]["bytes"] > 0
    assert "q4_0" not in drafts  # skipped by the family: not part of the pool
    assert all(d["compatible"] for d in drafts.values())  # a derived pool refuses nothing


def test_tune_full_size_sliding_window_layers_live(client, plain, http):
    """swa_full, live: at 4,096 tokens Gemma's window-sized cache (15 of 18 layers hold 1,024
    cells) is under half of the full-size one; the answer is the same either way."""

    def tune(changes: dict) -> dict:
        r = http.post("/admin/tune", json=changes)
        assert r.status_code == 200, r.text
        st = http.get("/admin/status").json()
        assert (
            st["state"] == "ready"
            and st["kv_cache"]["swa_full"] is r.json()["settings"]["swa_full"]
        )
        return st

    window = tune({"n_ctx": 4096})["working_set"]["target"]["kv"]
    full = tune({"swa_full": True})["working_set"]["target"]["kv"]
    assert full > 2 * window
    assert chat(client, "none").choices[0].message.content == plain.choices[0].message.content
    assert http.post("/admin/tune", json={"swa_full": "yes"}).status_code == 400
    tune({"swa_full": False, "n_ctx": 1024})
