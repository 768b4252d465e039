"""Ollama's API through the official `ollama` client, against the real daemon."""

from __future__ import annotations

import json
from typing import Literal

import ollama
import pytest
from launcher import API_KEY, MODEL, TARGET_FILE
from pydantic import BaseModel

from memspec.engine.sampling import SamplingParams
from memspec.server.ollama_api import OllamaMessage

QUESTION = "Name three primary colors."
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def oc(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.fixture(scope="module")
def plain_answer(reference_runtime) -> str:
    rt = reference_runtime
    prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": QUESTION}])
    return rt.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0), draft="none").text


def test_liveness_and_version(http):
    assert http.get("/").text == "Ollama is running"
    assert http.head("/").status_code == 200
    assert http.get("/api/version").json()["version"]


def test_tags_ps_show(oc):
    assert MODEL == "smollm2:135m"  # Ollama's library name, what a user types
    listed = oc.list().models
    names = [m.model for m in listed]
    assert names[0] == MODEL  # the default target first, then every other model in the dir
    assert len(set(names)) == len(names)
    assert not any("q2_k" in n or "q8_0" in n for n in names)  # built drafts are not models
    assert len(listed[0].digest) == 64 and listed[0].size > 0
    assert listed[0].details.format == "gguf" and listed[0].details.family == "llama"
    # The file's type, as Ollama reports it (general.file_type), not the dominant tensor type.
    assert listed[0].details.quantization_level == "F32"
    for m in listed:
        if m.model.startswith(("qwen2.5-coder:", "gemma3:")):
            assert m.details.quantization_level == "Q4_K_M", m.model
    (running,) = oc.ps().models
    assert running.model == MODEL and running.size > listed[0].size  # + KV and drafts
    from memspec.files import sha256_file
    from memspec.paths import models_dir

    assert listed[0].digest == sha256_file(models_dir() / TARGET_FILE)
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
        ({"keep_alive": "soon"}, 400, "keep_alive"),
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
    for body in ({"model": MODEL, "verbose": True}, {"model": MODEL, "colour": "red"}):
        r = http.post("/api/show", json=body)  # a field not honoured is named, never ignored
        assert r.status_code == 400 and list(body)[1] in r.json()["error"], r.text


def test_v1_without_model_serves_the_target(client, http):
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    )
    assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize("draft", ["none", "auto", "prompt-lookup", "q4_0"])
def test_api_chat_equals_v1_and_plain_with_each_draft(http, plain_answer, draft):
    """Greedy through Ollama's wire, with any draft, is the target's own output, as on /v1."""
    messages = [{"role": "user", "content": QUESTION}]
    r = http.post(
        "/api/chat",
        json={"model": MODEL, "messages": messages, "options": GREEDY, "stream": False}
        | {"draft": draft},
    )
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == plain_answer
    v1 = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
        | {"draft": draft},
    )
    assert v1.json()["choices"][0]["message"]["content"] == plain_answer


def test_generate_streams_ndjson(http):
    body = {"model": MODEL, "prompt": "The sky is", "raw": True, "options": GREEDY}
    with http.stream("POST", "/api/generate", json=body) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert len(lines) > 2 and lines[-1]["done"] and lines[-1]["eval_count"] == 12
    assert {"total_duration", "prompt_eval_count", "eval_duration", "memspec"} <= set(lines[-1])
    whole = http.post("/api/generate", json=body | {"stream": False}).json()
    assert "".join(line["response"] for line in lines) == whole["response"]


def test_tool_history_means_what_it_means_on_v1(oc, client):
    """A tool call and its result in Ollama's shapes (arguments as an object, tool_name)
    render as the same conversation in OpenAI's: the same greedy answer."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    ask = {"role": "user", "content": "Weather in Paris?"}
    r = oc.chat(
        model=MODEL,
        messages=[
            ask,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
        ],
        tools=[tool],
        options=GREEDY,
    )
    v1 = client.chat.completions.create(
        model=MODEL,
        messages=[
            ask,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1_0", "content": "18 C, sunny"},
        ],
        tools=[tool],
        max_tokens=12,
        temperature=0,
    )
    answer = v1.choices[0].message
    assert (r.message.content or "") == (answer.content or "")
    ours = [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls or []]
    theirs = [(c.function.name, json.loads(c.function.arguments)) for c in answer.tool_calls or []]
    assert ours == theirs


def test_ollama_tool_calls_carry_arguments_as_objects():
    from memspec.server.ollama_api import _ollama_tool_calls, _openai_messages

    calls = [{"function": {"name": "f", "arguments": {"x": 1}}}]
    oa = _openai_messages(
        [
            OllamaMessage(role="assistant", content="", tool_calls=calls),
            OllamaMessage(role="tool", content="2", tool_name="f"),
        ]
    )
    assert oa[1]["tool_call_id"] == oa[0]["tool_calls"][0]["id"]
    assert _ollama_tool_calls(oa[0]["tool_calls"]) == calls


def test_format_from_a_pydantic_model(oc):
    class Colour(BaseModel):
        name: Literal["red", "yellow", "blue"]
        primary: bool

    r = oc.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a primary colour as JSON."}],
        format=Colour.model_json_schema(),
        options={"temperature": 0, "num_predict": 64},
    )
    assert r.done_reason == "stop"
    assert Colour.model_validate_json(r.message.content).name in ("red", "yellow", "blue")


def test_chat_with_tools_streams_its_text(http):
    """Open WebUI sends its built-in tools with every chat: the answer must still stream (the
    splitter holds back only what may open a call), and add up to the whole answer."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [tool],
        "options": {"temperature": 0, "num_predict": 24},
    }
    with http.stream("POST", "/api/chat", json=body) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    whole = http.post("/api/chat", json=body | {"stream": False}).json()["message"]
    assert not whole.get("tool_calls")  # this question calls nothing (greedy: always so)
    with_text = [x for x in lines[:-1] if x["message"]["content"]]
    assert len(with_text) > 3, lines
    assert "".join(x["message"]["content"] for x in lines) == whole["content"]
    assert http.post("/api/show", json={"model": MODEL}).json()["capabilities"][:2] == [
        "completion",
        "tools",
    ]
