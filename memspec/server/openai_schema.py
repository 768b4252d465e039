"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are strict (a string where a number belongs is a 400, not a silent coercion). No
field that would change the output is dropped: every sampling field of OpenAI, llama-server
and vLLM is honoured or refused with a 400 naming it (REFUSED), llama-server's and vLLM's
names for ours are mapped (ALIASES), fields that cannot change the output are ignored
(IGNORED), and any other unknown field is a 400 naming it. docs/api.md tabulates them.
The extra request field `draft` and the extra
response object `memspec` are MemSpec's own.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from memspec.errors import InvalidRequest

UNLIMITED = 2**31 - 1  # max_tokens for "up to the context" (capped there, finish_reason length)
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_TOP_LOGPROBS = 20
MAX_N = 16  # choices per request: each is a generation of its own
MAX_LOGIT_BIAS = 1024  # entries

# Fields of other servers that change the output and that MemSpec does not implement: a 400
# naming the field when it is set to anything but its neutral value (what the predicate
# accepts), so nobody gets an answer made without what they asked for.
REFUSED: dict[str, tuple[Any, str]] = {
    "mirostat": (lambda v: v in (0, None), "mirostat sampling is not supported (use 0)"),
    "dry_multiplier": (lambda v: v in (0, None), "DRY sampling is not supported (use 0)"),
    "xtc_probability": (lambda v: v in (0, None), "XTC sampling is not supported (use 0)"),
    "top_n_sigma": (
        lambda v: v is None or (isinstance(v, int | float) and v <= 0),
        "top_n_sigma is not supported (use -1)",
    ),
    "dynatemp_range": (
        lambda v: v in (0, None),
        "dynamic temperature is not supported (use 0)",
    ),
    "samplers": (
        lambda v: v is None,
        "a custom sampler order is not supported: the order is fixed (docs/api.md)",
    ),
    "min_keep": (lambda v: v in (0, 1, None), "min_keep above 1 is not supported"),
    "n_probs": (lambda v: v in (0, None), "n_probs is not supported: use logprobs"),
    "t_max_predict_ms": (lambda v: v in (0, None), "t_max_predict_ms is not supported"),
    "n_indent": (lambda v: v in (0, None), "n_indent is not supported"),
    "lora": (lambda v: not v, "per-request LoRA adapters are not supported"),
    "image_data": (lambda v: not v, "images are not supported: the target is text-only"),
    "multimodal_data": (lambda v: not v, "multimodal input is not supported"),
    "chat_template_kwargs": (lambda v: not v, "chat_template_kwargs is not supported"),
    "min_tokens": (lambda v: v in (0, None), "min_tokens is not supported"),
    "include_stop_str_in_output": (
        lambda v: not v,
        "include_stop_str_in_output is not supported",
    ),
    "skip_special_tokens": (
        lambda v: v in (True, None),
        "skip_special_tokens false is not supported",
    ),
    "use_beam_search": (lambda v: not v, "beam search is not supported"),
    "guided_json": (lambda v: v is None, "use response_format json_schema"),
    "guided_regex": (lambda v: v is None, "regular-expression guidance is not supported"),
    "guided_choice": (lambda v: v is None, "guided_choice is not supported: use a grammar"),
    "guided_grammar": (lambda v: v is None, "use the grammar field (GBNF)"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
}

# Fields of other servers that cannot change the generated tokens here: accepted, ignored.
IGNORED: dict[str, str] = {
    "cache_prompt": "the KV cache of a shared prefix is always reused (output identical)",
    "id_slot": "the slot is chosen by the longest shared prefix",
    "n_keep": "no context shift: a prompt over the context is a 400",
    "mirostat_tau": "only with mirostat, which is refused",
    "mirostat_eta": "only with mirostat, which is refused",
    "dry_base": "only with dry_multiplier, which is refused",
    "dry_allowed_length": "only with dry_multiplier, which is refused",
    "dry_penalty_last_n": "only with dry_multiplier, which is refused",
    "dry_sequence_breakers": "only with dry_multiplier, which is refused",
    "xtc_threshold": "only with xtc_probability, which is refused",
    "dynatemp_exponent": "only with dynatemp_range, which is refused",
    "return_tokens": "a llama-server /completion response field",
    "timings_per_token": "a llama-server /completion response field",
    "post_sampling_probs": "a llama-server /completion response field",
    "response_fields": "a llama-server /completion response field",
    "return_progress": "a llama-server /completion response field",
    "store": "nothing is stored",
    "metadata": "nothing is stored",
    "service_tier": "one tier",
    "prompt_cache_key": "KV reuse is by shared prefix",
    "safety_identifier": "no moderation",
    "prediction": "a latency hint (predicted output); the output does not depend on it",
    "reasoning_effort": "the served targets do not reason",
    "reasoning_format": "no reasoning is parsed out",
    "length_penalty": "only with beam search, which is refused",
    "spaces_between_special_tokens": "special tokens are not shown",
}

# Other servers' names for our fields: name -> ours. Both given and different: a 400.
ALIASES: dict[str, str] = {
    "n_predict": "max_tokens",
    "repetition_penalty": "repeat_penalty",
}

# "cancelled": cut by disconnect/shutdown; "tool_calls": the answer is tool calls
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]  # "" stops at once
DraftField = Annotated[
    str,
    Field(
        max_length=64,
        description='MemSpec: a draft id, "none" (plain target decoding) or "auto" (default)',
    ),
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are kept (not validated) so check_supported can refuse or name them.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: Annotated[str | None, Field(max_length=256)] = None  # None: the served model
    # Capped to the context at run time; beyond llama-server's int32 n_predict is a 400.
    max_tokens: Annotated[int | None, Field(ge=1, le=UNLIMITED)] = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    n: Annotated[int | None, Field(ge=1, le=128)] = None
    seed: Annotated[int | None, Field(ge=-(2**63), le=2**64 - 1)] = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    # OpenAI's {"token id": bias}, or llama-server's [[token id, bias | false]]; false bans.
    logit_bias: dict[str, float | bool] | list[list[int | float | bool]] | None = None
    top_k: Annotated[int | None, Field(ge=-1)] = None  # <= 0: off
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    typical_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    repeat_penalty: Annotated[float | None, Field(gt=0.0, le=10.0)] = None
    repeat_last_n: Annotated[int | None, Field(ge=-1)] = None  # -1: the whole context
    ignore_eos: bool = False
    # vLLM's: token ids that end the text like EOS.
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP)] = []
    # Structured output (memspec/server/structured.py): at most one of them.
    response_format: dict[str, Any] | None = None
    grammar: Annotated[str | None, Field(max_length=200_000)] = None  # llama.cpp's GBNF
    json_schema: dict[str, Any] | bool | None = None  # llama-server's
    user: Annotated[str | None, Field(max_length=256)] = None
    draft: DraftField = "auto"
    policy: Annotated[
        str | None,
        Field(
            max_length=64,
            description='MemSpec: the policy for this request when draft is "auto" '
            "(memspec, ucb, exp3, fixed:<id>, ...); default: the daemon's",
        ),
    ] = None
    cache_salt: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=256,
            description="reuse cached prompt prefixes only among requests with this salt "
            "(and the same API key)",
        ),
    ] = None

    def _map_aliases(self, extra: dict[str, Any]) -> None:
        for alias, ours in ALIASES.items():
            if alias not in extra or extra[alias] is None:
                continue
            value = extra[alias]
            if alias == "n_predict":
                if not isinstance(value, int) or isinstance(value, bool) or value < -1 or not value:
                    raise InvalidRequest(
                        "n_predict must be a positive integer, or -1 (up to the context)",
                        param=alias,
                    )
                value = UNLIMITED if value == -1 else value  # -1: llama-server's "no limit"
            elif not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise InvalidRequest(f"{alias} must be a positive number", param=alias)
            mine = getattr(self, ours)
            if ours in self.model_fields_set and mine is not None and mine != value:
                raise InvalidRequest(f"{alias} and {ours} disagree; send one", param=alias)
            setattr(self, ours, value)

    def unknown_fields(self) -> list[str]:
        """Fields of the request this server does not know (check_supported refuses them)."""
        known = REFUSED.keys() | IGNORED.keys() | ALIASES.keys()
        return sorted(k for k in (self.model_extra or {}) if k not in known)

    def bias(self) -> dict[int, float]:
        """logit_bias as {token id: bias}; false (llama-server's ban) is -inf."""
        raw = self.logit_bias
        if not raw:
            return {}
        items = list(raw.items()) if isinstance(raw, dict) else raw
        if len(items) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias has {len(items)} entries; the limit is {MAX_LOGIT_BIAS}",
                param="logit_bias",
            )
        out: dict[int, float] = {}
        for item in items:
            if not isinstance(item, list | tuple) or len(item) != 2:
                raise InvalidRequest("logit_bias entries are [token id, bias]", param="logit_bias")
            key, value = item
            try:
                token = int(key) if not isinstance(key, bool | float) else None
            except ValueError:
                token = None
            if token is None or token < 0:
                raise InvalidRequest(
                    f"logit_bias key {key!r} is not a token id", param="logit_bias"
                )
            if value is False:
                out[token] = -math.inf
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(
                    f"logit_bias value for {token} must be a number or false",
                    param="logit_bias",
                )
            else:
                out[token] = float(value)
        return out

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling fields as ClientRequest takes them (None: not given, the default)."""
        return {
            "top_k": self.top_k,
            "min_p": self.min_p,
            "typical_p": self.typical_p,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.repeat_last_n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.bias(),
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
        }

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Reject what we would otherwise silently get wrong; map other servers' names."""
        if (self.n or 1) > MAX_N:
            raise InvalidRequest(f"n is at most {MAX_N}", param="n")
        if (self.n or 1) > 1 and self.stream:
            raise InvalidRequest("n above 1 is supported without stream", param="n")
        extra = self.model_extra or {}
        for name, value in extra.items():
            refused = REFUSED.get(name)
            if refused is not None and not refused[0](value):
                raise InvalidRequest(f"{name}: {refused[1]}", param=name)
        for name in self.unknown_fields():  # a typo or a field not implemented: never a 200
            raise InvalidRequest(
                f"unknown field {name!r}: not implemented here (docs/api.md lists every field)",
                param=name,
            )
        self._map_aliases(extra)
        self.bias()  # a malformed logit_bias is a 400 before anything runs
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true", param="stream_options"
            )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: Annotated[str, Field(max_length=256)]
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn."""

    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls forced by tool_choice always follow the schema


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: Annotated[str, Field(max_length=64)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Annotated[str | None, Field(max_length=256)] = None
    tool_calls: Annotated[list[ToolCallIn] | None, Field(max_length=128)] = None  # assistant
    tool_call_id: Annotated[str | None, Field(max_length=256)] = None  # tool: what it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int | None, Field(ge=1, le=UNLIMITED)] = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    tools: Annotated[list[ToolSpec] | None, Field(max_length=128)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    context_overflow: Literal["error", "shift"] | None = Field(
        None,
        description='MemSpec: a conversation over the context: "error" (400 '
        'context_length_exceeded) or "shift" (the oldest turns dropped); default: the daemon\'s',
    )

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        # OpenAI's deprecated names for tools and tool_choice.
        if self.functions:
            raise InvalidRequest("functions is deprecated: use tools", param="functions")
        if self.function_call not in (None, "none", "auto"):
            raise InvalidRequest(
                "function_call is deprecated: use tool_choice", param="function_call"
            )
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise InvalidRequest(
                    "max_tokens and max_completion_tokens disagree; send one",
                    param="max_completion_tokens",
                )

    def logprobs_n(self) -> int | None:
        """Alternatives per token for the engine (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        # Tool calls and results keep their fields (server/tools.py renders them).
        out: list[dict[str, Any]] = []
        for m in self.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
            d["content"] = m.text()
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                d["name"] = m.name
            out.append(d)
        return out

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(_SamplingRequest):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
            Field(min_length=1, max_length=1),
        ]
    )
    # OpenAI's default for completions
    max_tokens: Annotated[int | None, Field(ge=1, le=UNLIMITED)] = 16
    echo: bool = False
    best_of: Annotated[int | None, Field(ge=1, le=128)] = None
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    suffix: str | None = None  # fill-in-the-middle: the text after the completion

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if (self.best_of or 1) != 1:
            raise InvalidRequest("best_of must be 1", param="best_of")
        if self.suffix is not None and not isinstance(self.prompt_value(), str):
            raise InvalidRequest("suffix needs a text prompt (the prefix)", param="suffix")

    def prompt_value(self) -> str | list[int]:
        """A text prompt or a list of token ids (batches of one are unwrapped)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], str):
            return p[0]  # type: ignore[return-value]
        if p and isinstance(p[0], list):
            return list(p[0])  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class InfillExtra(_Strict):
    filename: Annotated[str, Field(max_length=1024)] = "tmp"
    text: str = ""


class InfillRequest(_SamplingRequest):
    """llama-server's /infill: the text before and after the hole, other files of the project,
    and `prompt`, the start of the middle. `model` is optional (one model is served)."""

    model: Annotated[str | None, Field(max_length=256)] = None  # type: ignore[assignment]
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[InfillExtra], Field(max_length=256)] = []
    prompt: str = ""


class TokenizeRequest(_Strict):
    """llama-server's /tokenize."""

    content: str
    add_special: bool = False  # BOS, when the tokenizer adds one
    parse_special: bool = True  # control-token text becomes the control token
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[Annotated[int, Field(ge=0)]]


# --- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KSummary(BaseModel):
    mean: float
    max: int
    counts: dict[str, int] = Field(description="rounds per draft length k (0: plain decoding)")


class ContextShift(BaseModel):
    dropped_messages: int = Field(description="messages dropped after the system prompt")
    dropped_tokens: int = Field(description="prompt tokens they took")


class MemSpecStats(BaseModel):
    """MemSpec's account of how the answer was decoded."""

    policy: str = Field(
        description="the round policy it ran under: none, auto, memspec, ucb, exp3, fixed:<id> "
        "(auto beside the lead slot, and on a lead among other requests where memspec is "
        "configured)"
    )
    lead_slot: bool = Field(
        description="decoded on the lead slot (every draft kind), else beside it (free drafts)"
    )
    drafts_used: dict[str, int] = Field(description="draft id -> rounds it drafted")
    proposed: int
    accepted: int
    acceptance: float
    rounds: int
    k: KSummary
    stall_s: float = Field(description="seconds waiting on draft loads")
    ttft_s: float
    tokens_per_s: float
    phases_ms: dict[str, float] = Field(
        description="milliseconds per phase of its rounds (prefill, choose, draft_steps, "
        "verify_decode: the target's forward passes, sample, detokenize, stream...)"
    )
    elapsed_ms: float = Field(description="from admission to its last token")
    context_shift: ContextShift | None = Field(
        None, description='context_overflow "shift": the oldest turns dropped to fit the context'
    )


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """The target's raw log-probabilities of the answer's tokens (docs/api.md)."""

    content: list[TokenLogprobOut]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer is tool calls only
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    memspec: MemSpecStats


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A completion, or (object the same, OpenAI's convention) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    memspec: MemSpecStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "memspec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": desc}
    for status, desc in (
        (400, "invalid request (bad JSON, wrong type, prompt over the context)"),
        (401, "missing or invalid API key"),
        (404, "unknown model or draft"),
        (413, "request body too large"),
        (429, "request queue full (see Retry-After)"),
        (500, "the engine failed on this request"),
        (503, "models loading or daemon shutting down"),
    )
}
