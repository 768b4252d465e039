"""Tool formats without a daemon (memspec/server/tools.py): what each chat template gets,
how calls are read back whole and streamed, and that the forcing grammars parse in llama.cpp."""

from __future__ import annotations

import json

import pytest
from launcher import TARGET_FILE, require_testbed

from memspec.backends.chat import ChatTemplate, render_chat
from memspec.engine.grammar import Grammar
from memspec.paths import models_dir
from memspec.server import tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# The parts of Qwen2.5's template that tools go through (its GGUF has the whole of it).
QWEN_LIKE = (
    "{% if tools %}<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}</tools>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}{% for c in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
LLAMA3_LIKE = "{% if tools %}Environment: ipython {{ tools | tojson }}{% endif %}<|python_tag|>"
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris <3"}'},
            }
        ],
    },
    {"role": "tool", "content": "21C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "clear", "tool_call_id": "call_1"},
]
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


def test_formats_follow_the_template():
    assert tools.tool_format(ChatTemplate("gguf", jinja=QWEN_LIKE)) == "hermes"
    assert tools.tool_format(ChatTemplate("gguf", jinja=LLAMA3_LIKE)) == "llama3"
    assert tools.tool_format(ChatTemplate("builtin:chatml", builtin="chatml")) == "hermes-prompt"


def test_template_gets_tools_and_history_as_transformers_gives_them():
    template = ChatTemplate("gguf", jinja=QWEN_LIKE)
    chat = tools.prepare_chat(HISTORY, template, [WEATHER])
    text = render_chat(QWEN_LIKE, chat.messages, tools=chat.request_fields()["tools"])
    assert json.dumps(WEATHER) in text  # transformers' tojson: no HTML escapes
    assert '"arguments": {"city": "Paris <3"}' in text  # arguments as an object again
    assert chat.grammar is None  # auto: nothing forced


def test_template_without_tools_gets_them_in_a_system_message():
    template = ChatTemplate("chatml-fallback", jinja="{% for m in messages %}{{ m }}{% endfor %}")
    chat = tools.prepare_chat(HISTORY, template, [WEATHER], "required")
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "user"]  # the two results in one turn
    assert "<tools>" in chat.messages[0]["content"] and chat.request_fields()["tools"] is None
    assert chat.messages[2]["content"].startswith("<tool_call>\n")
    assert chat.messages[3]["content"].count("<tool_response>") == 2
    assert chat.grammar_param == "tools"


def test_none_renders_no_tools_and_a_named_choice_must_exist():
    template = ChatTemplate("gguf", jinja=QWEN_LIKE)
    assert tools.prepare_chat(HISTORY, template, [WEATHER], "none").tools is None
    with pytest.raises(tools.InvalidRequest) as e:
        tools.prepare_chat(HISTORY, template, [WEATHER], {"function": {"name": "nope"}})
    assert e.value.param == "tool_choice"


def test_calls_parse_whole_and_streamed():
    plan = tools.plan_tools(ChatTemplate("gguf", jinja=QWEN_LIKE), [WEATHER], "auto", None)
    content, calls = plan.parse("Let me look.\n" + CALLS)
    assert content == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    for size in (1, 3, 7):
        stream = plan.stream()
        text, calls_by_index, pieces = "", {}, 0
        whole = "Let me look.\n" + CALLS
        for i in range(0, len(whole), size):
            c, deltas = stream.feed(whole[i : i + size])
            text += c
            for d in deltas:  # OpenAI's rules: id and name once, arguments appended
                call = calls_by_index.setdefault(d["index"], {"name": "", "arguments": ""})
                call["name"] += d["function"].get("name", "")
                call["arguments"] += d["function"]["arguments"]
                pieces += 1
        c, deltas = stream.finish()
        assert not deltas
        assert (text + c).strip() == "Let me look."
        assert [calls_by_index[i] for i in (0, 1)] == [c["function"] for c in calls]
        assert pieces > 4 or size == 7  # the arguments went out as they came
    assert plan.parse("<tool_call>\nnot json\n</tool_call>") == (
        "<tool_call>\nnot json\n</tool_call>",
        [],
    )


def test_llama3_calls():
    plan = tools.plan_tools(ChatTemplate("gguf", jinja=LLAMA3_LIKE), [WEATHER], "auto", None)
    content, calls = plan.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert plan.parse("Oslo is cold.") == ("Oslo is cold.", [])
    stream = plan.stream()
    assert stream.feed('{"name": "get_weather", ') == ("", [])
    assert stream.feed('"parameters": {"city": "Oslo"}}') == ("", [])
    _, deltas = stream.finish()
    assert json.loads(deltas[0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("jinja", [QWEN_LIKE, LLAMA3_LIKE, None])
def test_forcing_grammars_parse_in_llama_cpp(jinja):
    require_testbed()
    template = ChatTemplate("gguf", jinja=jinja) if jinja else ChatTemplate("b", builtin="chatml")
    for choice in ("required", {"function": {"name": "get_time"}}):
        time_tool = {"type": "function", "function": {"name": "get_time"}}
        plan = tools.plan_tools(template, [WEATHER, time_tool], choice, True)
        Grammar(plan.grammar(), models_dir() / TARGET_FILE)  # raises if llama.cpp refuses it


def test_hermes_call_without_its_tags():
    """Qwen2.5-Coder-1.5B often writes its call as a ```json block: a call when it is the
    whole answer and names a known function; other code blocks stream as they come."""
    plan = tools.plan_tools(ChatTemplate("gguf", jinja=QWEN_LIKE), [WEATHER], "auto", None)
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```'
    content, calls = plan.parse(fenced)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert plan.parse('{"name": "unknown", "arguments": {}}')[1] == []
    stream = plan.stream()
    assert stream.feed(fenced[:9]) == ("", []) and stream.feed(fenced[9:]) == ("", [])
    _, deltas = stream.finish()
    assert deltas[0]["function"]["name"] == "get_weather"
    stream = plan.stream()
    assert stream.feed("```py") == ("```py", [])  # not JSON: no holding back
    stream = plan.stream()
    assert stream.feed("```json\n[1, 2]\n") == ("", [])
    assert stream.finish() == ("```json\n[1, 2]\n", [])
