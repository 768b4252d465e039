"""OpenAI tools (function calling) and structured output, in the target's own chat format.

A chat's tools reach the model the way its chat template expects, and its calls are parsed
back into OpenAI `tool_calls` (whole responses and SSE deltas). Formats (`tool_format`):
  - "hermes": templates that render `tools` and call with `<tool_call>` (Qwen2.5, Qwen3,
    Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call;
  - "llama3": Llama 3.x templates (JSON tool calling): `{"name": ..., "parameters": {...}}`,
    perhaps after `<|python_tag|>`;
  - "hermes-prompt": templates with no place for tools (SmolLM2, ChatML, llama.cpp's
    built-ins): the tools are described in a system message in Qwen2.5's own words, history
    calls and results become Hermes text, and Hermes calls are parsed.
tool_choice `required` and a named function constrain the output with a grammar (llama.cpp's
JSON-schema converter over the functions' parameters), so it always parses; `auto` parses
what the model wrote; `none` renders no tools.

What response_format / grammar / json_schema ask for: memspec/server/structured.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from memspec.backends.chat import ChatTemplate
from memspec.errors import InvalidRequest
from memspec.server.structured import json_schema_grammar, structured_output

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FENCE = "```json"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
_BARE_RE = re.compile(r"\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*", re.S)
# A call's start up to its arguments object: what lets the arguments stream as they come.
_HEADER_RE = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)

# Qwen2.5's template's words, for models whose template has no place for tools.
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tool_format(template: ChatTemplate) -> str:
    """How the target's chat template takes tools and writes calls (the module doc)."""
    if template.takes_tools and template.jinja is not None:
        if CALL_OPEN in template.jinja:
            return "hermes"
        if PYTHON_TAG in template.jinja or "ipython" in template.jinja:
            return "llama3"
    return "hermes-prompt"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """A request's tools as this target takes them: what the template gets, the grammar that
    forces a call (required / named), and how calls are read back."""

    format: str
    tools: list[dict[str, Any]]  # OpenAI's: {"type": "function", "function": {...}}
    choice: str  # "auto" | "required" | a function's name
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the Jinja template renders (None: described in a message instead)."""
        return self.tools if self.format != "hermes-prompt" else None

    def system_text(self) -> str:
        tools = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in self.tools)
        return HERMES_SYSTEM.format(tools=tools)

    def grammar(self) -> str | None:
        """GBNF for `required` / a named function: exactly the format's call(s) of the
        functions allowed, their arguments as their parameters' schema says."""
        if not self.forced:
            return None
        names = [t["function"]["name"] for t in self.tools]
        if self.choice != "required":
            names = [self.choice]
        key = "parameters" if self.format == "llama3" else "arguments"
        alternatives = []
        for t in self.tools:
            fn = t["function"]
            if fn["name"] not in names:
                continue
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            alternatives.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, key: params},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
            )
        schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        rules = json_schema_grammar(schema, param="tools", name="call")
        if self.format == "llama3":  # Llama 3.x calls one function at a time
            return rules + "\nroot ::= call"
        one = f'"{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"'
        root = f'{one} ("\\n" {one})*' if self.parallel and self.choice == "required" else one
        return rules + f"\nroot ::= {root}"

    # --- reading calls back ---------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole answer; content None when it is only calls."""
        if self.format == "llama3":
            call = _llama3_call(text)
            return (None, [call]) if call is not None else (text, [])
        calls: list[dict[str, Any]] = []
        rest: list[str] = []
        pos = 0
        for m in _CALL_RE.finditer(text):
            call = _call_from_json(m.group(1))
            if call is None:
                continue  # not a call after all: it stays in the content
            rest.append(text[pos : m.start()])
            calls.append(call)
            pos = m.end()
        tail = text[pos:]
        # A last call the model ended (EOS, max_tokens at the very end) without its closing tag.
        start = tail.find(CALL_OPEN)
        if start >= 0:
            call = _call_from_json(tail[start + len(CALL_OPEN) :])
            if call is not None:
                calls.append(call)
                tail = tail[:start]
        rest.append(tail)
        if not calls:
            bare = self.bare_call(text)
            return (None, [bare]) if bare is not None else (text, [])
        content = "".join(rest).strip()
        return content or None, calls

    def bare_call(self, text: str) -> dict[str, Any] | None:
        """A Hermes model's call written without its tags: the whole answer one
        {"name", "arguments"} object of a known function, perhaps in a ```json fence
        (Qwen2.5-Coder-1.5B answers so; llama.cpp's Hermes parser takes it too)."""
        m = _BARE_RE.fullmatch(text)
        call = _call_from_json(m.group(1)) if m else None
        names = {t["function"]["name"] for t in self.tools}
        return call if call is not None and call["function"]["name"] in names else None

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _call_from_json(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from a model's {"name", "arguments" | "parameters"} object."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    # OpenAI's arguments are a JSON text: the model's own (what a stream sends as it comes),
    # and a model that wrote them as a string meant that text.
    raw = _raw_arguments(body)
    if raw is not None and json.loads(raw) == args:
        arguments = raw
    else:
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {
        "id": _call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def _object_end(text: str, start: int) -> int | None:
    """Just past the JSON object that opens at text[start], None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _raw_arguments(body: str) -> str | None:
    """The arguments object of a {"name", "arguments"} call as the model wrote it."""
    m = _HEADER_RE.match(body)
    end = _object_end(body, m.end()) if m else None
    return body[m.end() : end] if m and end is not None else None


def _llama3_call(text: str) -> dict[str, Any] | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    return _call_from_json(body)


@dataclass
class ToolStream:
    """Splits a streamed answer into content deltas and OpenAI tool-call deltas: text that
    might open a call is held back until it does or cannot. A Hermes call goes out as OpenAI
    streams one: a first delta with its id and name once they are written, then its
    arguments as they come; one that does not start that way goes out whole at its closing
    tag (or not at all, as content, if it is no call). Llama 3's JSON calls go out whole."""

    plan: ToolPlan
    buf: str = ""
    in_call: bool = False
    calls: int = 0
    _llama3_hold: bool | None = None  # llama3: an answer that may be one JSON call
    # Whether the answer may be one call without its tags (held back whole); None: not known.
    _bare: bool | None = None
    # The call being streamed: where its arguments start in buf, how much of them went out.
    _open: dict[str, int] | None = field(default=None)

    def _progress(self) -> list[dict[str, Any]]:
        """Deltas for the call in buf so far (no closing tag yet)."""
        out: list[dict[str, Any]] = []
        if self._open is None:
            m = _HEADER_RE.match(self.buf)
            if m is None:
                return out
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return out
            self._open = {"start": m.end(), "sent": 0}
            out.append(
                {
                    "index": self.calls,
                    "id": _call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
        start, sent = self._open["start"], self._open["sent"]
        end = _object_end(self.buf, start)
        piece = self.buf[start + sent : end if end is not None else len(self.buf)]
        if piece:
            self._open["sent"] += len(piece)
            out.append({"index": self.calls, "function": {"arguments": piece}})
        return out

    def _close(self, body: str) -> tuple[str, list[dict[str, Any]]]:
        """The call whose body is complete: its rest, or the whole of it."""
        call = _call_from_json(body)
        if self._open is None:
            if call is None:
                return CALL_OPEN + body + CALL_CLOSE, []
            return "", [self._delta(call)]
        start, sent = self._open["start"], self._open["sent"]
        self._open = None
        self.calls += 1
        streamed = body[start : start + sent]
        args = call["function"]["arguments"] if call is not None else ""
        if call is None or not args.startswith(streamed):
            return "", []  # not a well-formed call after all; what went out cannot come back
        rest = args[len(streamed) :]
        return "", [{"index": self.calls - 1, "function": {"arguments": rest}}] if rest else []

    def _delta(self, call: dict[str, Any]) -> dict[str, Any]:
        out = {"index": self.calls, **call}
        self.calls += 1
        return out

    def _content(self, text: str) -> str:
        # Whitespace between or after calls is layout, not an answer.
        return "" if self.calls and not text.strip() else text

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.plan.format == "llama3":
            return self._feed_llama3(text)
        self.buf += text
        if self._bare is None and not self.calls and not self.in_call:
            head = self.buf.lstrip()
            if not head or (FENCE.startswith(head) and head != FENCE):
                return "", []  # too early to tell
            self._bare = head.startswith(("{", FENCE))
        if self._bare:  # may be one bare call (bare_call): it is known at the end
            return "", []
        content, deltas = "", []
        while True:
            if not self.in_call:
                i = self.buf.find(CALL_OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buf, CALL_OPEN)
                    content += self._content(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                content += self._content(self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(CALL_OPEN) :], True
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                deltas += self._progress()
                break
            body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(CALL_CLOSE) :], False
            c, d = self._close(body)
            content, deltas = content + c, deltas + d
        return content, deltas

    def _feed_llama3(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        if self._llama3_hold is None:
            head = self.buf.lstrip()
            if not head:
                return "", []
            self._llama3_hold = head.startswith("{") or PYTHON_TAG.startswith(head[:14])
        if self._llama3_hold:
            return "", []
        out, self.buf = self.buf, ""
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held back, at the end of the answer."""
        if self._bare is not False and self.plan.format != "llama3":
            call = self.plan.bare_call(self.buf)
            if call is not None:
                self.buf = ""
                return "", [self._delta(call)]
            self._bare = False  # not a call: the answer goes out as it would have
            content, deltas = self.feed("")
            more, rest = self.finish()
            return content + more, deltas + rest
        buf, self.buf = self.buf, ""
        if self.plan.format == "llama3":
            call = _llama3_call(buf) if self._llama3_hold else None
            return ("", [self._delta(call)]) if call is not None else (buf, [])
        if self.in_call:  # a last call the model ended without its closing tag
            self.in_call = False
            if self._open is None and _call_from_json(buf) is None:
                return CALL_OPEN + buf, []
            return self._close(buf)
        return self._content(buf), []


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may open it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# --- requests -------------------------------------------------------------------------------


def plan_tools(
    template: ChatTemplate,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> ToolPlan | None:
    """The request's tools on this target; None when no tool may be called."""
    if isinstance(tool_choice, dict):
        choice = tool_choice.get("function", {}).get("name", "")
    else:
        choice = tool_choice or "auto"
    if not tools or choice == "none":
        if choice not in ("none", "auto"):
            raise InvalidRequest(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: two functions have the same name", param="tools")
    if choice not in ("auto", "required") and choice not in names:
        raise InvalidRequest(
            f"tool_choice names {choice!r}, which is not in tools", param="tool_choice"
        )
    return ToolPlan(tool_format(template), tools, choice, parallel_tool_calls is not False)


def chat_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template: ChatTemplate
) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: assistant tool calls and tool results
    as the template's format has them (structured for one that renders tools, Hermes text for
    the rest), and the tools' description where the template has no place for them."""
    structured = tool_format(template) != "hermes-prompt"
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            if structured:  # templates print arguments with tojson: they expect an object
                out.append(
                    {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [
                            {
                                "id": c["id"],
                                "type": "function",
                                "function": {
                                    "name": c["function"]["name"],
                                    "arguments": _arguments_value(c["function"]["arguments"]),
                                },
                            }
                            for c in calls
                        ],
                    }
                )
            else:
                text = "\n".join(
                    f"{CALL_OPEN}\n"
                    + json.dumps(
                        {
                            "name": c["function"]["name"],
                            "arguments": _arguments_value(c["function"]["arguments"]),
                        },
                        ensure_ascii=False,
                    )
                    + f"\n{CALL_CLOSE}"
                    for c in calls
                )
                out.append(
                    {"role": "assistant", "content": f"{content}\n{text}" if content else text}
                )
        elif role == "tool":
            if structured:
                tool = {"role": "tool", "content": content}
                call_id = m.get("tool_call_id")
                if call_id:
                    tool["tool_call_id"] = call_id
                name = m.get("name") or names.get(call_id or "")
                if name:
                    tool["name"] = name
                out.append(tool)
            else:  # Hermes: results come back in a user turn, consecutive ones together
                wrapped = f"<tool_response>\n{content}\n</tool_response>"
                if out and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n" + wrapped
                else:
                    out.append({"role": "user", "content": wrapped, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if plan is not None and plan.format == "hermes-prompt":
        text = plan.system_text()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass
class ChatPlan:
    """A chat request made ready for the engine: the messages and tools its template
    renders, the grammar its output must follow, and how to read tool calls back."""

    messages: list[dict[str, Any]]
    tools: ToolPlan | None
    grammar: str | None
    grammar_param: str

    def request_fields(self) -> dict[str, Any]:
        """ClientRequest's fields for this chat."""
        return {
            "messages": self.messages,
            "tools": self.tools.template_tools() if self.tools is not None else None,
            "grammar": self.grammar,
            "grammar_param": self.grammar_param,
        }

    def answer(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The assistant message and finish_reason for a whole answer."""
        content, calls = self.tools.parse(text) if self.tools is not None else (text, [])
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> ToolStream | None:
        return self.tools.stream() if self.tools is not None else None


def stream_delta(
    stream: ToolStream | None, text: str | None, finish: str | None
) -> tuple[dict[str, Any], str | None]:
    """A streamed chunk's delta and finish_reason: the text as it is, or through `stream`
    (content held back while it may open a tool call; calls as tool_calls deltas)."""
    if stream is None:
        return ({} if text is None else {"content": text}), finish
    if text is not None:
        content, calls = stream.feed(text)
    elif finish is not None:
        content, calls = stream.finish()
    else:
        content, calls = "", []
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    if finish == "stop" and stream.calls:
        finish = "tool_calls"
    return delta, finish


def prepare_chat(
    messages: list[dict[str, Any]],
    template: ChatTemplate,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    response_format: dict[str, Any] | None = None,
    grammar: str | None = None,
    json_schema: dict[str, Any] | bool | None = None,
) -> ChatPlan:
    """A chat request's ChatPlan on a target whose chat template is `template`."""
    plan = plan_tools(template, tools, tool_choice, parallel_tool_calls)
    gbnf, param = structured_output(response_format, grammar, json_schema)
    if plan is not None and plan.forced:
        if gbnf is not None:
            raise InvalidRequest(
                f"tool_choice {plan.choice!r} forces a tool call; {param} cannot also "
                "constrain the output",
                param=param,
            )
        gbnf, param = plan.grammar(), "tools"
    return ChatPlan(chat_messages(messages, plan, template), plan, gbnf, param)
