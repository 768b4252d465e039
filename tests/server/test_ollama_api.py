"""Ollama's API through the official `ollama` client, against the real daemon."""

from __future__ import annotations

import ollama
import pytest
from launcher import API_KEY, MODEL, TARGET_FILE

from memspec.engine.sampling import SamplingParams

QUESTION = "Name three primary colors."
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def oc(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.fixture(scope="module")
def plain_answer(reference_runtime) -> str:
    rt = reference_runtime
    prompt = rt.prompt_tokens(messages=[{"role": "user", "content": QUESTION}])
    return rt.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0), draft="none").text


def test_liveness_and_version(http):
    assert http.get("/").text == "Ollama is running"
    assert http.head("/").status_code == 200
    assert http.get("/api/version").json()["version"]


def test_tags_ps_show(oc):
    assert MODEL == "smollm2:135m"  # Ollama's library name, what a user types
    listed = oc.list().models
    assert [m.model for m in listed] == [MODEL]
    assert len(listed[0].digest) == 64 and listed[0].size > 0
    assert listed[0].details.format == "gguf" and listed[0].details.family == "llama"
    (running,) = oc.ps().models
    assert running.model == MODEL and running.size > listed[0].size  # + KV and drafts
    shown = oc.show(MODEL)
    assert "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.template


def test_chat_greedy_is_the_targets_own_output(oc, plain_answer):
    r = oc.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=GREEDY)
    assert r.message.content == plain_answer
    assert r.eval_count == 12 and r.done_reason == "length" and r.total_duration > 0
    parts = list(
        oc.chat(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            options=GREEDY,
            stream=True,
        )
    )
    assert "".join(p.message.content for p in parts) == plain_answer
    assert parts[-1].done and not any(p.done for p in parts[:-1])


def test_generate_raw_and_aliases(oc):
    for name in (MODEL, f"{TARGET_FILE}", "smollm2-135m-f32:latest"):
        g = oc.generate(model=name, prompt="The sky is", raw=True, options=GREEDY)
        assert g.model == MODEL and g.eval_count == 12
    loaded = oc.generate(model=MODEL, prompt="")
    assert loaded.done_reason == "load"


def test_format_json(oc):
    import json

    r = oc.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object."}],
        format="json",
        options={"temperature": 0, "num_predict": 200},
    )
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    else:
        assert r.message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("kwargs", "status", "word"),
    [
        ({"model": "nope"}, 404, "nope"),
        ({"options": {"mirostat": 1}}, 400, "mirostat"),
        ({"options": {"num_ctx": 1 << 20}}, 400, "num_ctx"),
        ({"think": True}, 400, "think"),
        ({"keep_alive": 0}, 400, "keep_alive"),
    ],
)
def test_ollama_errors(oc, kwargs, status, word):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **kwargs}
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(**args)
    assert e.value.status_code == status and word in e.value.error


def test_error_body_is_ollamas(http):
    r = http.post("/api/chat", content=b"{not json")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_v1_without_model_serves_the_target(client, http):
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    )
    assert r.status_code == 200 and r.json()["model"] == MODEL
