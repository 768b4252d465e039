"""Embeddings on the real daemon: Ollama's /api/embed and /api/embeddings through the official
`ollama` client, OpenAI's /v1/embeddings through the official `openai` client."""

from __future__ import annotations

import base64

import numpy as np
import ollama
import openai
import pytest
from launcher import API_KEY, MODEL

from memspec.errors import BudgetExceeded

SKY = "Why is the sky blue?"
GRASS = "Quarks are held together by gluons."
N_EMBD = 576  # SmolLM2-135M's hidden size


@pytest.fixture(scope="module")
def oc(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})


def unit(v: list[float]) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    return a / np.linalg.norm(a)


def close(a: list[float] | np.ndarray, b: list[float] | np.ndarray) -> bool:
    return np.allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_one_text_one_vector_on_every_route(client, oc):
    (v1,) = client.embeddings.create(model=MODEL, input=SKY, encoding_format="float").data
    api = oc.embed(model=MODEL, input=SKY)
    legacy = oc.embeddings(model=MODEL, prompt=SKY).embedding
    assert api.model == MODEL and api.prompt_eval_count > 0 and api.total_duration > 0
    (vec,) = api.embeddings
    assert len(vec) == N_EMBD and abs(np.linalg.norm(vec) - 1) < 1e-5
    assert close(v1.embedding, vec)
    # Ollama's legacy route returns the model's vector as it comes: not unit length, the same
    # direction.
    assert abs(np.linalg.norm(legacy) - 1) > 1e-2
    assert close(unit(legacy), vec)


def test_openai_client_default_base64_batch_and_usage(client):
    # The openai client asks for base64 unless told otherwise, and decodes it itself.
    r = client.embeddings.create(model=MODEL, input=[SKY, GRASS])
    assert r.object == "list" and r.model == MODEL
    assert [d.index for d in r.data] == [0, 1] and all(d.object == "embedding" for d in r.data)
    a, b = (np.asarray(d.embedding) for d in r.data)
    assert abs(np.linalg.norm(a) - 1) < 1e-5 and abs(np.linalg.norm(b) - 1) < 1e-5
    assert float(a @ b) < 0.99  # different texts, different vectors
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0


def test_batch_equals_singles(oc):
    both = oc.embed(model=MODEL, input=[SKY, GRASS]).embeddings
    singles = [oc.embed(model=MODEL, input=t).embeddings[0] for t in (SKY, GRASS)]
    assert close(both[0], singles[0]) and close(both[1], singles[1])
    assert not close(both[0], both[1])


def test_dimensions_cut_and_normalise(client, oc):
    full = oc.embed(model=MODEL, input=SKY).embeddings[0]
    (short,) = oc.embed(model=MODEL, input=SKY, dimensions=64).embeddings
    assert len(short) == 64 and close(short, unit(full[:64]))
    (v1,) = client.embeddings.create(model=MODEL, input=SKY, dimensions=64).data
    assert close(v1.embedding, short)
    with pytest.raises(openai.BadRequestError) as e:  # more than the model has: refused
        client.embeddings.create(model=MODEL, input=SKY, dimensions=N_EMBD + 1)
    assert e.value.body["param"] == "dimensions"


def test_token_ids_and_base64_on_the_wire(http):
    ids = http.post("/tokenize", json={"content": SKY, "add_special": True}).json()["tokens"]
    by_text = http.post("/v1/embeddings", json={"input": SKY}).json()
    by_ids = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"})
    assert by_ids.status_code == 200, by_ids.text
    raw = base64.b64decode(by_ids.json()["data"][0]["embedding"])
    assert close(np.frombuffer(raw, dtype="<f4"), by_text["data"][0]["embedding"])
    assert by_text["model"] == MODEL  # `model` may be left out


def test_truncate(oc, http):
    # truncate (Ollama's default): cut to the context; num_ctx bounds it as in Ollama.
    cut = oc.embed(model=MODEL, input="word " * 200, options={"num_ctx": 16})
    assert cut.prompt_eval_count == 16 and len(cut.embeddings[0]) == N_EMBD
    with pytest.raises(ollama.ResponseError) as e:
        oc.embed(model=MODEL, input="word " * 200, truncate=False, options={"num_ctx": 16})
    assert e.value.status_code == 400 and "context length" in e.value.error
    # Over the daemon's whole context (1024): refused before anything is computed.
    r = http.post("/api/embed", json={"input": ["hi", "word " * 1100], "truncate": False})
    assert r.status_code == 400 and "context length" in r.json()["error"]


def test_errors(client, oc, http):
    with pytest.raises(ollama.ResponseError) as e:
        oc.embed(model="nope", input=SKY)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(openai.NotFoundError) as e2:
        client.embeddings.create(model="nope", input=SKY)
    assert e2.value.body["code"] == "model_not_found"
    for bad in ("", [], [""], [[]]):
        r = http.post("/v1/embeddings", json={"input": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", (bad, r.text)
    r = http.post("/v1/embeddings", json={"input": [[10**9]]})  # outside the vocabulary
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={"input": SKY, "encoding_format": "int8"})
    assert r.status_code == 400
    r = http.post("/api/embed", json={"input": ["a", ""]})
    assert r.status_code == 400 and r.json() == {"error": "input[1] is empty"}
    r = http.post("/api/embed", json={"input": [1, 2]})
    assert r.status_code == 400 and r.json()["error"] == "invalid input type"
    r = http.post("/api/embed", json={"input": SKY, "options": {"mirostat": 1}})
    assert r.status_code == 400 and "mirostat" in r.json()["error"]
    # No input: Ollama loads the model and answers no embeddings.
    assert oc.embed(model=MODEL, input="").embeddings == []
    assert oc.embeddings(model=MODEL, prompt="").embedding == []


def test_generation_unchanged_and_footprint_reported(http, admin_http):
    ask = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    before = http.post("/v1/completions", json=ask).json()["choices"][0]["text"]
    assert http.post("/api/embed", json={"input": SKY}).status_code == 200
    assert http.post("/v1/completions", json=ask).json()["choices"][0]["text"] == before
    ws = admin_http.get("/admin/status").json()["working_set"]
    emb = ws["embedding"]
    assert emb["loaded"] and emb["shares_target_weights"] and emb["pooling"] == "last"
    assert emb["bytes"]["weights"] == 0 and emb["bytes"]["kv"] > 0
    assert ws["reserved_bytes"] >= ws["target"]["total"] + emb["bytes"]["total"]


def test_keep_alive_zero_releases(oc, admin_http):
    oc.embed(model=MODEL, input=SKY, keep_alive=0)
    ws = admin_http.get("/admin/status").json()["working_set"]
    assert not ws["embedding"]["loaded"]
    assert len(oc.embed(model=MODEL, input=SKY).embeddings[0]) == N_EMBD  # loaded again


def test_a_budget_without_room_is_a_503_with_the_reason():
    """The embedding context's bytes are charged before it is allocated: a budget that holds
    the target but not it refuses, and nothing is charged."""
    from launcher import N_CTX, require_testbed

    from memspec.config import Settings
    from memspec.memory.footprint import target_footprint
    from memspec.paths import resolve_model_path
    from memspec.runtime import Runtime
    from memspec.server.errors import EmbeddingsUnavailable, http_error

    require_testbed()
    settings = Settings.load(drafts=[], n_ctx=N_CTX, n_threads=1)
    fp = target_footprint(resolve_model_path(settings.target), N_CTX, settings.k_max)
    tight = settings.model_copy(update={"budget": fp.total + (1 << 20)})
    rt = Runtime(tight, calibrate_costs=False)
    try:
        used = rt.modelled_bytes()
        with pytest.raises(BudgetExceeded, match="embedding context .* needs"):
            rt.embeddings.get()
        assert rt.modelled_bytes() == used and not rt.embeddings.status()["loaded"]
    finally:
        rt.close()
    assert http_error(EmbeddingsUnavailable("x")).status == 503
