"""Real Ollama clients, with their default settings (only the base URL and the model set),
against a real daemon: langchain-ollama's ChatOllama and OllamaEmbeddings, LiteLLM's
`ollama_chat/` and `ollama/` embeddings, and the official `ollama` client.

The clients leave sampling to the model, as Ollama's users do (temperature 0.8 unless the model
says otherwise), so the chat model here is one whose Modelfile makes it greedy: an Ollama store
laid out by the test (tests/test_ollama_store.py's write_model), SmolLM2's Q8_0 GGUF as its
blob with `.params` `temperature 0` and a token limit. Every client's answer is then compared,
word for word, with what the daemon gives the `ollama` client asked greedily on its own. The
embeddings are the default target's (docs/api.md, "Embeddings").

What each client sends, as captured against this daemon (docs/ollama.md, "Clients"):
langchain-ollama's embeddings every option, the unset ones as null (`"mirostat": null`,
`"num_thread": null`, ...); LiteLLM `"images": []` on every message and `/api/show` with the
older `name` field; ChatOllama and LiteLLM `"options": {}`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import pytest
from langchain_ollama import ChatOllama, OllamaEmbeddings
from launcher import MODEL, running

from memspec.paths import models_dir
from tests.server.test_ollama_store_serving import GGUF, _link_blob
from tests.test_ollama_store import write_model

pytestmark = pytest.mark.models

GREEDY = "smol-greedy:135m"  # the store model whose .params make it greedy
PARAMS = {"temperature": 0, "num_predict": 24}
QUESTION = "What is the capital of France? Answer in one sentence."
TEXTS = ["Why is the sky blue?", "Quarks are held together by gluons."]
N_EMBD = 576  # SmolLM2-135M's hidden size


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = models_dir() / GGUF
    if not source.is_file():
        pytest.skip(f"{GGUF} is not in the models dir (memspec testbed fetch)")
    root = tmp_path_factory.mktemp("ollama") / "models"
    _link_blob(root, source)  # the blob is the GGUF itself (a hard link): write_model keeps it
    write_model(
        root,
        "registry.ollama.ai/library/smol-greedy/135m",
        [
            ("application/vnd.ollama.image.model", source.read_bytes()),
            ("application/vnd.ollama.image.params", json.dumps(PARAMS).encode()),
        ],
    )
    return root


@pytest.fixture(scope="module")
def daemon(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """No API key: the clients' defaults send none."""
    env = {"MEMSPEC_OLLAMA_MODELS": str(store)}
    with running(tmp_path_factory.mktemp("daemon"), "lookup", env=env) as d:
        yield d


@pytest.fixture(scope="module")
def oc(daemon: Any) -> ollama.Client:
    return ollama.Client(host=daemon.url)


@pytest.fixture(scope="module")
def greedy(oc: ollama.Client) -> str:
    """The answer the `ollama` client gets asking for greedy decoding itself."""
    answer = oc.chat(
        model=GREEDY,
        messages=[{"role": "user", "content": QUESTION}],
        options={"temperature": 0, "num_predict": PARAMS["num_predict"]},
        stream=False,
    ).message.content
    assert answer.strip()
    return answer


@pytest.fixture(scope="module")
def litellm() -> Any:
    # LiteLLM fetches its price table from GitHub when imported unless told to use its own
    # copy: the test machine has no internet, and the table changes nothing asked here.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def unit_vectors(vectors: list[list[float]]) -> np.ndarray:
    a = np.asarray(vectors, dtype=np.float64)
    assert a.shape[1] == N_EMBD
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    return a


# --- the ollama client ---------------------------------------------------------------------


def test_ollama_client_list_show_chat(oc: ollama.Client, greedy: str) -> None:
    listed = {m.model: m for m in oc.list().models}
    assert {MODEL, GREEDY} <= set(listed)
    assert listed[GREEDY].details.format == "gguf" and listed[GREEDY].details.family == "llama"
    shown = oc.show(GREEDY)
    assert "temperature" in shown.parameters and "num_predict" in shown.parameters
    assert shown.details.parameter_size == "135M" and "<|im_start|>" in shown.template
    # the client's defaults (no options): the model's .params make it greedy
    messages = [{"role": "user", "content": QUESTION}]
    assert oc.chat(model=GREEDY, messages=messages).message.content == greedy
    streamed = "".join(c.message.content for c in oc.chat(GREEDY, messages, stream=True))
    assert streamed == greedy


# --- langchain-ollama ----------------------------------------------------------------------


def test_chat_ollama_invoke_and_stream(daemon: Any, greedy: str) -> None:
    chat = ChatOllama(model=GREEDY, base_url=daemon.url)
    answer = chat.invoke(QUESTION)
    assert answer.content == greedy
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0
    chunks = [c.content for c in chat.stream(QUESTION)]
    assert len([c for c in chunks if c]) > 1 and "".join(chunks) == greedy


def test_ollama_embeddings_documents_and_query(daemon: Any, oc: ollama.Client) -> None:
    """langchain-ollama sends every option, the unset ones as null: a null option is not set."""
    embeddings = OllamaEmbeddings(model=MODEL, base_url=daemon.url)
    documents = unit_vectors(embeddings.embed_documents(TEXTS))
    query = unit_vectors([embeddings.embed_query(TEXTS[0])])[0]
    reference = unit_vectors(oc.embed(model=MODEL, input=TEXTS).embeddings)
    assert np.allclose(documents, reference, atol=1e-6)
    assert np.allclose(query, reference[0], atol=1e-6)
    assert float(documents[0] @ documents[1]) < 0.99  # two texts, two directions


# --- LiteLLM -------------------------------------------------------------------------------


def test_litellm_ollama_chat_sync_and_stream(daemon: Any, litellm: Any, greedy: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    model = f"ollama_chat/{GREEDY}"
    answer = litellm.completion(model=model, api_base=daemon.url, messages=messages)
    assert answer.choices[0].message.content == greedy
    assert answer.usage.completion_tokens > 0
    stream = litellm.completion(model=model, api_base=daemon.url, messages=messages, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream]
    assert len([c for c in chunks if c]) > 1 and "".join(chunks) == greedy


def test_litellm_ollama_embedding(daemon: Any, litellm: Any, oc: ollama.Client) -> None:
    answer = litellm.embedding(model=f"ollama/{MODEL}", api_base=daemon.url, input=TEXTS)
    vectors = unit_vectors([d["embedding"] for d in answer.data])
    assert np.allclose(vectors, oc.embed(model=MODEL, input=TEXTS).embeddings, atol=1e-6)


# --- the embedding context beside another model (issue 53) ----------------------------------


def resident(url: str) -> set[str]:
    return {m["name"] for m in httpx.get(url + "/api/ps", timeout=30).json()["models"]}


def test_the_embedding_context_makes_room_as_a_load_does(
    daemon: Any, oc: ollama.Client, store: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An embedding after a chat on another model was a 503 (the budget left no room beside the
    idle chat model). Now the idle model hands back the share it does not use; where the
    budget cannot hold all three, the idle model is unloaded, as Ollama does."""
    messages = [{"role": "user", "content": QUESTION}]
    oc.chat(model=GREEDY, messages=messages)
    oc.embed(model=MODEL, input=TEXTS[0], keep_alive=0)  # its context freed after the answer
    oc.embed(model=MODEL, input=TEXTS[0])
    assert resident(daemon.url) == {MODEL, GREEDY}  # room enough: nothing unloaded
    status = httpx.get(daemon.url + "/admin/status", timeout=30).json()
    embedding = status["working_set"]["embedding"]["bytes"]["total"]
    both = sum(m["bytes"] for m in status["models"] if m["resident"]) - embedding
    # A budget that holds both models, but not the embedding context beside them.
    tight = {"budget": both + embedding // 2}
    env = {"MEMSPEC_OLLAMA_MODELS": str(store)}
    with running(tmp_path_factory.mktemp("tight"), "lookup", settings=tight, env=env) as d:
        tight_client = ollama.Client(host=d.url)
        tight_client.chat(model=GREEDY, messages=messages)
        assert resident(d.url) == {MODEL, GREEDY}
        vectors = unit_vectors(tight_client.embed(model=MODEL, input=TEXTS).embeddings)
        assert np.allclose(vectors, oc.embed(model=MODEL, input=TEXTS).embeddings, atol=1e-6)
        assert resident(d.url) == {MODEL}  # the idle chat model made the room
        assert tight_client.chat(model=GREEDY, messages=messages).message.content.strip()
