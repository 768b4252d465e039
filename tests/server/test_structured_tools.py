"""Structured output and tools through the official `openai` client, against the real daemon.

response_format (json_schema via `chat.completions.parse`, json_object), llama.cpp's
`grammar`, and tools (a forced call streamed and reassembled, history with calls and results)
on the shared SmolLM2 daemon, whose template has no place for tools (Hermes calls described
in a system message); and one call on the Qwen2.5-Coder target, whose own template renders
the tools, when that model is there.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from launcher import API_KEY, MODEL
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_parse_pydantic_same_with_and_without_a_draft(client):
    """json_schema (strict) from a pydantic model: a valid instance, whatever the draft."""
    outs = []
    for draft in ("none", "auto", "prompt-lookup", "q4_0"):
        r = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a large city and its country, as JSON."}],
            response_format=City,
            temperature=0,
            max_tokens=64,
            extra_body={"draft": draft},
        )
        assert isinstance(r.choices[0].message.parsed, City), draft
        outs.append(r.choices[0].message.content)
    assert len(set(outs)) == 1, outs


def test_grammar_and_json_object_on_both_endpoints(client):
    yes_no = {"grammar": 'root ::= "yes" | "no"'}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=8,
        temperature=0,
        extra_body=yes_no,
    )
    assert chat.choices[0].message.content in ("yes", "no")
    assert chat.choices[0].finish_reason == "stop"
    text = client.completions.create(
        model=MODEL, prompt="Is water wet? Answer:", max_tokens=8, temperature=0, extra_body=yes_no
    )
    streamed = client.completions.create(
        model=MODEL,
        prompt="Is water wet? Answer:",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body=yes_no,
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert text.choices[0].text in ("yes", "no")
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert obj.choices[0].message.content.startswith("{")


def test_structured_output_errors_name_their_field(client):
    cases = [
        ({"grammar": "root ::= undefined"}, "grammar"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "grammar": 'root ::= "a"'}, "grammar"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=ASK_WEATHER, max_tokens=4, extra_body=extra
            )
        assert e.value.body["param"] == param, (extra, e.value.body)


def _reassemble(stream) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """Content, tool calls by index (OpenAI's delta rules: name once, arguments appended)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_forced_tool_call_streams_and_parses(client):
    """required and a named function: the output always parses into calls; streamed deltas
    reassemble into the same valid arguments as the whole answer."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=0,
            max_tokens=64,
            parallel_tool_calls=False,
        )
        whole = client.chat.completions.create(**kw)
        msg = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls", msg
        assert msg.tool_calls and msg.content is None
        call = msg.tool_calls[0]
        assert call.id and call.type == "function"
        if choice != "required":
            assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        content, calls, finish = _reassemble(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (call.function.name, args)
        ]


def test_tool_history_and_auto(client):
    """An assistant turn with tool calls and the tool's result render; `auto` answers with
    text or calls, always well-formed."""
    messages = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"temperature": 21, "sky": "clear"}',
        },
    ]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER],
            tool_choice=choice,
            temperature=0,
            max_tokens=24,
        )
        msg = r.choices[0].message
        assert msg.content or msg.tool_calls
        for call in msg.tool_calls or []:
            json.loads(call.function.arguments)
        if choice == "none":
            assert not msg.tool_calls


def test_qwen_tool_call_in_its_own_format(qwen_server):
    """Qwen2.5-Coder's template renders the tools itself; unforced, the model answers with
    its call (as a Hermes <tool_call>, or as this 1.5B does, a ```json block of it): parsed,
    and streamed as tool-call deltas."""
    client = openai.OpenAI(
        base_url=qwen_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600
    )
    model = httpx.get(qwen_server.url + "/health").json()["model"]
    kw = dict(model=model, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=40)
    content, calls, finish = _reassemble(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls", content
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"])["city"] == "Paris"
