"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are strict (a string where a number belongs is a 400, not a silent coercion), ignore
unknown fields the way most OpenAI-compatible servers do, and reject the OpenAI features this
server does not implement with a clear message instead of ignoring them. The extra request
field `draft` and the extra response object `memspec` are MemSpec's own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from memspec.errors import InvalidRequest

MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024

FinishReason = Literal["stop", "length", "cancelled"]  # "cancelled": cut by disconnect/shutdown
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

    model: Annotated[str, Field(max_length=256)]
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    n: Annotated[int | None, Field(ge=1, le=128)] = None
    seed: Annotated[int | None, Field(ge=-(2**63), le=2**64 - 1)] = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    logit_bias: dict[str, float] | None = None
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

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Reject what we would otherwise silently get wrong."""
        if (self.n or 1) != 1:
            raise InvalidRequest("n must be 1: one choice per request is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidRequest(f"{name} is not supported (use 0)", param=name)
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true", param="stream_options"
            )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Annotated[str | None, Field(max_length=256)] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest("logprobs are not supported", param="logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} (function calling) is not supported", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise InvalidRequest(f"{name} is not supported", param=name)
        if self.response_format and self.response_format.get("type") != "text":
            raise InvalidRequest(
                'only response_format {"type": "text"} is supported', param="response_format"
            )
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise InvalidRequest(
                    "max_tokens and max_completion_tokens disagree; send one",
                    param="max_completion_tokens",
                )

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


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
    max_tokens: Annotated[int | None, Field(ge=1)] = 16  # OpenAI's default for completions
    echo: bool = False
    best_of: Annotated[int | None, Field(ge=1, le=128)] = None
    logprobs: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if (self.best_of or 1) != 1:
            raise InvalidRequest("best_of must be 1", param="best_of")
        if self.logprobs is not None:
            raise InvalidRequest("logprobs are not supported", param="logprobs")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")

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


class MemSpecStats(BaseModel):
    """MemSpec's account of how the answer was decoded."""

    drafts_used: dict[str, int] = Field(description="draft id -> rounds it drafted")
    proposed: int
    accepted: int
    acceptance: float
    rounds: int
    k: KSummary
    stall_s: float = Field(description="seconds waiting on draft loads")
    ttft_s: float
    tokens_per_s: float


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: FinishReason
    logprobs: None = None


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
    logprobs: None = None


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
