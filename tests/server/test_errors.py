"""Every failure answers an OpenAI-shaped error with the right status, and nothing breaks."""

from __future__ import annotations

import json

import openai
import pytest
from launcher import MODEL, N_CTX

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def assert_openai_error(resp, status: int, code: str | None = None, param: str | None = None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    "raw",
    [b'{"model": "x", "messages": [', b"not json at all", b'{"model": "x",}', b"\xff\xfe\xfa"],
)
def test_malformed_json(http, raw):
    r = http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": MSG, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": MSG, "max_tokens": "12"}, "max_tokens"),
        ({"model": MODEL, "messages": MSG, "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "messages": MSG, "temperature": 5}, "temperature"),
        ({"model": MODEL, "messages": MSG, "stop": [1, 2]}, "stop"),
        ({"model": MODEL, "messages": MSG, "stop": ["x"] * 1000}, "stop"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": 5, "messages": MSG}, "model"),  # left out, it is the served model
        ({"model": MODEL, "messages": MSG, "stream": "yes"}, "stream"),
    ],
)
def test_wrong_types_are_400_not_422(http, body, param):
    err = assert_openai_error(http.post(CHAT, json=body), 400)
    assert err["param"] == param or (err["param"] or "").startswith(param), err


def test_lone_surrogates_are_400(http):
    bad = "a\ud800b"  # legal JSON (an escape), not encodable as UTF-8

    def post(path: str, body: dict):
        raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800
        return http.post(path, content=raw, headers={"Content-Type": "application/json"})

    chat = {"model": MODEL, "messages": [{"role": "user", "content": bad}]}
    assert_openai_error(post(CHAT, chat), 400, param="messages")
    assert_openai_error(
        post("/v1/completions", {"model": MODEL, "prompt": bad}), 400, "invalid_request", "prompt"
    )


def test_body_not_an_object(http):
    assert_openai_error(http.post(CHAT, json=[1, 2, 3]), 400)


def test_nan_rejected(http):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], ' % MODEL.encode()
    raw += b'"temperature": NaN}'
    assert_openai_error(
        http.post(CHAT, content=raw, headers={"Content-Type": "application/json"}), 400
    )


def test_unknown_model(client, http):
    assert_openai_error(
        http.post(CHAT, json={"model": "gpt-4", "messages": MSG}), 404, "model_not_found", "model"
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MSG, max_tokens=2)


def test_unknown_draft(http):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2}
    for draft in ("no-such-draft", "../../etc/passwd"):
        assert_openai_error(
            http.post(CHAT, json=body | {"draft": draft}), 404, "draft_not_found", "draft"
        )
        r = http.post(CHAT, json=body | {"draft": draft, "stream": True})
        assert_openai_error(r, 404, "draft_not_found")  # before the stream starts


def test_unknown_policy(http):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2}
    for stream in (False, True):
        r = http.post(CHAT, json=body | {"policy": "no-such-policy", "stream": stream})
        assert_openai_error(r, 400, param="policy")  # before any stream starts


def test_prompt_over_context(client, http):
    long = "word " * (N_CTX + 100)
    assert_openai_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": long}),
        400,
        "context_length_exceeded",
        "prompt",
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long}], stream=True
        )
    assert e.value.code == "context_length_exceeded"
    # A max_tokens beyond the context is capped there, not refused (test_openai_api.py).


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"n": 2, "stream": True}, "n"),  # n above 1: not streamed
        ({"n": 17}, "n"),
        ({"mirostat": 2}, "mirostat"),
        ({"samplers": ["top_k", "temperature"]}, "samplers"),
        ({"dry_multiplier": 0.8}, "dry_multiplier"),
        ({"n_probs": 3}, "n_probs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"n_predict": 0}, "n_predict"),
        ({"n_predict": 5, "max_tokens": 6}, "n_predict"),
        ({"top_k": "3"}, "top_k"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
    ],
)
def test_unsupported_features_are_clear_400s(http, extra, param):
    assert_openai_error(
        http.post(CHAT, json={"model": MODEL, "messages": MSG} | extra), 400, param=param
    )


def test_fill_in_the_middle_needs_fim_tokens(client, http):
    """The testbed target (SmolLM2) has no FIM tokens: suffix and /infill name the field."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f(", suffix="    return x\n")
    assert e.value.body["param"] == "suffix" and "fill-in-the-middle" in e.value.message
    r = http.post("/infill", json={"input_prefix": "def f(", "input_suffix": "\n"})
    assert_openai_error(r, 400, param="input_suffix")


def test_oversize_body_is_413(http):
    big = {"model": MODEL, "prompt": "x" * (2 << 20)}
    assert_openai_error(http.post("/v1/completions", json=big), 413, "request_too_large")


def test_api_key_required(server):
    import httpx

    r = httpx.get(server.url + "/v1/models")
    assert_openai_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert_openai_error(r, 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nope"), 404)
    assert_openai_error(http.delete("/v1/models"), 405)
    # An OpenAI endpoint that is not served says so.
    err = assert_openai_error(
        http.post("/v1/moderations", json={"input": "hi"}), 404, "unsupported_endpoint"
    )
    assert "moderation" in err["message"]
    # Ollama's Anthropic and transcription shims are refused by name too.
    for path in ("/v1/messages", "/v1/audio/transcriptions"):
        assert_openai_error(http.post(path, json={}), 404, "unsupported_endpoint")


def test_openapi_schema(http):
    spec = http.get("/openapi.json").json()
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/admin/status"):
        assert path in spec["paths"], path
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "draft" in props and "max_completion_tokens" in props


def test_still_serving_after_errors(client):
    r = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
