"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

HTTP-level checks run here (model, fields, text, size); the engine thread checks the request
against the models once (RequestCheck.check) and answers once it has produced its first event,
so errors found before any token (unknown draft, prompt over the context) get their own
status even for a stream. Streams are SSE: `data: {chunk}` per text delta, a last chunk with
finish_reason (and `memspec`), a usage chunk when asked for, then `data: [DONE]`. A client
that disconnects, queued or streaming, cancels its generation.

llama-server's own routes live here too (`llama_router`, no /v1 prefix): /tokenize,
/detokenize and /infill (fill-in-the-middle), in its request and response shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

import memspec
from memspec.backends.chat import ChatTemplate
from memspec.engine.fim import FimRequest
from memspec.engine.sampling import TokenLogprob
from memspec.engine.speculative import Generation
from memspec.errors import InvalidRequest
from memspec.request_check import ClientRequest
from memspec.server import structured, tools
from memspec.server.auth import request_partition, require_api_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.engine_state import state_error
from memspec.server.errors import NotReady, UnknownModel, as_memspec_error, error_json
from memspec.server.openai_schema import (
    ALIASES,
    ERROR_RESPONSES,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    InfillRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from memspec.server.worker import Done, Event, Failed, GenerateJob, Token

router = APIRouter(
    prefix="/v1",
    tags=["openai"],
    dependencies=[Depends(require_api_key)],
    responses=ERROR_RESPONSES,
)

# llama-server's routes: the same keys, no /v1 prefix.
llama_router = APIRouter(
    tags=["llama.cpp"], dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES
)

FINGERPRINT = f"memspec-{memspec.__version__}"
DISCONNECT_POLL_S = 0.25
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"}
}


class ClientGone(Exception):
    pass


# --- helpers -------------------------------------------------------------------------------


def usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def memspec_stats(gen: Generation) -> dict[str, Any]:
    """The `memspec` object: `policy` is the one the request ran under (`auto` beside the
    lead slot, or for a lead among other requests, even where `memspec` is configured)."""
    ks = gen.k_per_round
    out = {
        "policy": gen.policy,
        "lead_slot": gen.lead,
        "drafts_used": dict(gen.drafts_used),
        "proposed": gen.proposed,
        "accepted": gen.accepted,
        "acceptance": round(gen.acceptance, 4),
        "rounds": gen.rounds,
        "k": {
            "mean": round(sum(ks) / len(ks), 3) if ks else 0.0,
            "max": max(ks, default=0),
            "counts": {str(k): n for k, n in sorted(Counter(ks).items())},
        },
        "stall_s": round(gen.stall_s, 4),
        "ttft_s": round(gen.ttft_s, 4),
        "tokens_per_s": round(gen.tokens_per_s, 2),
        # Where the generation's time went (docs/daemon.md "Where the time goes"); the
        # rest of elapsed_s is the engine's loop between rounds and other requests' rounds.
        "phases_ms": {p: round(s * 1e3, 3) for p, s in gen.phases.items()},
        "elapsed_ms": round(gen.elapsed_s * 1e3, 3),
    }
    if gen.context_shift:  # context_overflow "shift": the oldest turns it dropped
        out["context_shift"] = gen.context_shift
    return out


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat's `logprobs` object for these tokens."""
    return {
        "content": [
            {
                "token": _token_text(e.piece),
                "logprob": e.logprob,
                "bytes": list(e.piece),
                "top_logprobs": [
                    {"token": _token_text(p), "logprob": lp, "bytes": list(p)} for _, p, lp in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions' `logprobs` object; `offset`: characters before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        text = _token_text(e.piece)
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(p): lp for _, p, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def served_model(ctx: ServerContext) -> str:
    """The served model id; NotReady until the target has loaded (the id is its metadata's)."""
    model_id = ctx.model_id
    if model_id is None:
        w = ctx.worker
        # No id yet: the target has not loaded (a reload keeps the id), so never served.
        refused = state_error(w.state, w.error)
        raise refused or NotReady("models are loading; retry shortly", code="model_loading")
    return model_id


def chat_template(ctx: ServerContext, model: str) -> ChatTemplate:
    """The chat template of the served model `model` (tools and structured output are planned
    against it): its runtime's when resident, else read from its file."""
    rt = ctx.worker.targets.runtime(model)
    if rt is not None:
        return rt.chat_template
    found = ctx.worker.catalog.find(model)
    if found is None:  # removed from the models dir since check_model
        raise UnknownModel(f"The model {model!r} does not exist (see /v1/models)", param="model")
    return ctx.worker.catalog.chat_template(found)


def check_model(ctx: ServerContext, model: str | None) -> str:
    """The served name of the model `model` names (any of its names: memspec.catalog), or the
    default target's when the request names none (as llama-server and Ollama's clients
    expect)."""
    served = served_model(ctx)
    if not model or model == served:
        return served
    found = ctx.worker.catalog.find(model)
    if found is None:
        # A file that is there but bad: say why (422), not that it does not exist.
        unusable = ctx.worker.catalog.unusable(model)
        if unusable is not None:
            raise unusable
        raise UnknownModel(
            f"The model {model!r} does not exist; this server serves {served!r} and the other "
            "models in its models dir (see /v1/models)",
            param="model",
        )
    return found.name


def check_text(param: str, *texts: str) -> None:
    """JSON can carry lone surrogates (\\ud800) that no tokenizer can encode: a 400, not a 500."""
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"{param} contains invalid Unicode (a lone surrogate)", param=param
            ) from None


def check_prompt_size(ctx: ServerContext, chars: int) -> None:
    limit = ctx.settings.max_prompt_chars
    if chars > limit:
        raise InvalidRequest(
            f"prompt has {chars} characters; the limit is {limit}",
            param="prompt",
            code="prompt_too_long",
        )


async def next_event(request: Request, job: GenerateJob) -> Event:
    """The job's next event; cancels the job and raises ClientGone if the client leaves."""
    get = asyncio.ensure_future(job.next_event())
    try:
        while True:
            done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
            if done:
                return get.result()
            if await request.is_disconnected():
                job.cancel.set()
                raise ClientGone()
    finally:
        if not get.done():
            get.cancel()


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def run_request(
    request: Request,
    ctx: ServerContext,
    req: ClientRequest,
    stream: bool,
    include_usage: bool,
    chunk: Callable[[str | None, str | None, list[TokenLogprob] | None], dict[str, Any]],
    final: Callable[[Generation], dict[str, Any]],
    preamble: dict[str, Any] | None = None,
    last: Callable[[Generation], dict[str, Any]] | None = None,
    done_marker: bool = True,
    frame: Callable[[dict[str, Any] | str], str] = sse,
    error_event: Callable[[Any], dict[str, Any]] = error_json,
    media_type: str = "text/event-stream",
) -> Response | dict[str, Any]:
    """Queue the generation; answer JSON (final(gen)) or an SSE stream of chunk(...)s: text,
    finish reason, and the logprob entries of the tokens the text completes (None: not asked).
    `last(gen)`: the stream's last event instead of the finish chunk (llama-server's shape);
    `done_marker`: end with [DONE] (OpenAI's streams; llama-server's own routes do not);
    `frame`, `error_event`, `media_type`: the stream's wire format (SSE; Ollama's NDJSON)."""
    job = GenerateJob(asyncio.get_running_loop(), req, stream)
    ctx.worker.submit(job)
    try:
        first = await next_event(request, job)
    except ClientGone:
        return Response(status_code=499)
    if isinstance(first, Failed):
        raise as_memspec_error(first.error)
    if not stream:
        assert isinstance(first, Done)
        return final(first.result)

    async def events() -> AsyncIterator[str]:
        ev: Event = first
        sent = 0  # logprob entries streamed so far
        try:
            if preamble is not None:
                yield frame(preamble)
            while True:
                if isinstance(ev, Token):
                    sent += len(ev.logprobs or ())
                    yield frame(chunk(ev.text, None, ev.logprobs))
                elif isinstance(ev, Done):
                    gen: Generation = ev.result
                    # Tokens whose text never went out (cut by a stop string) keep their entries.
                    rest = gen.logprobs[sent:] if gen.logprobs is not None else None
                    end = last(gen) if last is not None else chunk(None, gen.finish_reason, rest)
                    end["memspec"] = memspec_stats(gen)
                    yield frame(end)
                    if include_usage:
                        tail = chunk(None, None, None)
                        tail["choices"] = []
                        tail["usage"] = usage(gen)
                        yield frame(tail)
                    if done_marker:
                        yield frame("[DONE]")
                    return
                else:  # Failed mid-stream: an OpenAI error event, then the end
                    yield frame(error_event(as_memspec_error(ev.error)))
                    if done_marker:
                        yield frame("[DONE]")
                    return
                ev = await job.next_event()
        finally:
            job.cancel.set()  # the client left (or we are done): stop generating now

    return StreamingResponse(
        events(),
        media_type=media_type,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def run_choices(
    request: Request,
    ctx: ServerContext,
    req: ClientRequest,
    n: int,
    final: Callable[[Generation], dict[str, Any]],
) -> Response | dict[str, Any]:
    """`n` choices of one request, not streamed: n generations (they share the slots like
    separate requests), choice i seeded `seed + i` when a seed is given; usage counts the
    prompt once and every choice's tokens."""
    loop = asyncio.get_running_loop()
    jobs: list[GenerateJob] = []
    try:
        for i in range(n):
            seed = None if req.seed is None else req.seed + i
            jobs.append(GenerateJob(loop, dataclasses.replace(req, seed=seed), False))
            ctx.worker.submit(jobs[-1])
        answers = []
        for job in jobs:
            ev = await next_event(request, job)
            if isinstance(ev, Failed):
                raise as_memspec_error(ev.error)
            assert isinstance(ev, Done)
            answers.append(final(ev.result))
    except ClientGone:
        return Response(status_code=499)
    finally:
        for job in jobs:  # the others, when one failed or the client left
            job.cancel.set()
    out = answers[0]
    out["choices"] = [dict(a["choices"][0], index=i) for i, a in enumerate(answers)]
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    out["usage"]["completion_tokens"] = completion
    out["usage"]["total_tokens"] = out["usage"]["prompt_tokens"] + completion
    return out


def _sampling(body: ChatCompletionRequest | CompletionRequest | InfillRequest) -> dict[str, Any]:
    return {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        # llama.cpp's -1 is "a random seed".
        "seed": None if body.seed == -1 else body.seed,
        "stop": body.stop_list(),
        "draft": body.draft,
        "policy": body.policy,
        **body.sampling_fields(),
    }


# Ollama's OpenAI routes (openai/openai.go FromChatRequest, FromCompleteRequest) set these
# options on every request, the request's value or OpenAI's default, so a store model's .params
# never reaches them there; /v1/completions sets the penalties too (0 when not given).
_ALWAYS_SET = {
    "chat": frozenset({"temperature", "top_p"}),
    "completion": frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty"}),
}


def apply_store_defaults(
    ctx: ServerContext, body: ChatCompletionRequest | CompletionRequest
) -> None:
    """A store model's defaults on /v1, as Ollama's OpenAI routes get them (they become its
    ChatRequest / GenerateRequest, whose handlers apply the model's layers): its `.params`
    options under the request's own fields (the same options /api/chat applies:
    ollama_api.store_options), and on a chat its `.messages` before the request's and its
    `.system` when the chat opens with no system (or developer) message of its own.
    /v1/completions runs the prompt as it is (OpenAI's), so no system prompt goes there, as on
    /api/generate with raw. A loose file or an unknown name: nothing (planning says why)."""
    found = ctx.worker.catalog.find(body.model) if body.model else None
    entry = found.store if found is not None else None
    if entry is None:
        return
    # ollama_api imports this module: import its option rules when first needed
    from memspec.server.ollama_api import OPTION_FIELDS, store_options

    chat = isinstance(body, ChatCompletionRequest)
    for key, value in store_options(entry).items():
        field = OPTION_FIELDS[key]
        if key in _ALWAYS_SET["chat" if chat else "completion"] or _given(body, field):
            continue  # the request's own field wins
        if key == "num_predict" and (
            value in (-1, -2) or (chat and body.max_completion_tokens is not None)
        ):
            continue  # Ollama's "to the end" is /v1's default; or the request set its limit
        try:
            # checked as the request's own field would be (a layer is no more trusted)
            type(body).__pydantic_validator__.validate_assignment(
                body, field, [value] if key == "stop" and isinstance(value, str) else value
            )
        except ValidationError as e:
            reason = e.errors()[0].get("msg", "invalid")
            raise InvalidRequest(
                f"model {entry.name.display} sets {key} {value!r} in its .params layer, which "
                f"/v1 cannot take as {field}: {reason}",
                param="model",
            ) from None
    if chat and (entry.messages or entry.system):
        own = list(body.messages)
        turns = [ChatMessage(role=m["role"], content=m["content"]) for m in entry.messages]
        if entry.system and own[0].role not in ("system", "developer"):
            turns.insert(0, ChatMessage(role="system", content=entry.system))
        body.messages = turns + own


def _given(body: ChatCompletionRequest | CompletionRequest, field: str) -> bool:
    """Whether the request sets `field` itself, or by a llama-server alias (n_predict)."""
    extra = body.model_extra or {}
    aliases = (alias for alias, ours in ALIASES.items() if ours == field)
    return getattr(body, field) is not None or any(extra.get(a) is not None for a in aliases)


def structured_output(body: CompletionRequest | InfillRequest) -> dict[str, Any]:
    """ClientRequest's grammar fields for response_format / grammar / json_schema."""
    gbnf, param = structured.structured_output(body.response_format, body.grammar, body.json_schema)
    return {"grammar": gbnf, "grammar_param": param}


# --- routes --------------------------------------------------------------------------------


@router.get("/models", response_model=ModelList)
async def list_models(ctx: Ctx) -> ModelList:
    """Every servable model, the default target first."""
    served_model(ctx)  # NotReady while loading
    models = await asyncio.to_thread(ctx.worker.catalog.models)
    return ModelList(data=[ModelCard(id=m.name, created=int(ctx.started_at)) for m in models])


@router.get("/models/{model_id}", response_model=ModelCard)
async def get_model(model_id: str, ctx: Ctx) -> ModelCard:
    return ModelCard(id=check_model(ctx, model_id), created=int(ctx.started_at))


def plan_chat(
    request: Request, ctx: ServerContext, body: ChatCompletionRequest
) -> tuple[str, tools.ChatPlan, ClientRequest]:
    """A chat request checked and made ready for the engine: (model, its plan, the request).
    Ollama's /api/chat comes through here too (memspec/server/ollama_api.py)."""
    model = check_model(ctx, body.model)
    body.check_supported()
    # Tools, tool calls in the history, and structured output, as the target's template takes
    # them (memspec/server/tools.py).
    choice = body.tool_choice
    chat = tools.prepare_chat(
        body.message_dicts(),
        chat_template(ctx, model),
        body.tool_dicts(),
        choice.model_dump() if choice is not None and not isinstance(choice, str) else choice,
        body.parallel_tool_calls,
        body.response_format,
        body.grammar,
        body.json_schema,
    )
    messages = chat.messages
    check_text("messages", *(m["content"] for m in messages))
    check_text("stop", *body.stop_list())
    check_prompt_size(ctx, sum(len(m["content"]) for m in messages))
    req = ClientRequest(
        max_tokens=body.token_limit(),
        logprobs=body.logprobs_n(),
        context_overflow=body.context_overflow,
        **chat.request_fields(),
        **_sampling(body),
        model=model,
    )
    req.cache_partition = request_partition(request, body.cache_salt)
    return model, chat, req


@router.post("/chat/completions", response_model=ChatCompletion, responses=STREAM_RESPONSES)
async def chat_completions(request: Request, body: ChatCompletionRequest, ctx: Ctx) -> Any:
    apply_store_defaults(ctx, body)
    model, chat, req = plan_chat(request, ctx, body)
    tool_stream = chat.stream() if body.stream else None
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(
        text: str | None, finish: str | None, lps: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        delta, finish = tools.stream_delta(tool_stream, text, finish)
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": chat_logprobs(lps) if lps else None,
                }
            ],
        }

    def final(gen: Generation) -> dict[str, Any]:
        message, finish = chat.answer(gen.text, gen.finish_reason)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": chat_logprobs(gen.logprobs) if gen.logprobs is not None else None,
                }
            ],
            "usage": usage(gen),
            "memspec": memspec_stats(gen),
        }

    preamble = chunk(None, None)
    preamble["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    if (body.n or 1) > 1:
        return await run_choices(request, ctx, req, body.n or 1, final)
    return await run_request(
        request,
        ctx,
        req,
        body.stream,
        body.include_usage(),
        chunk,
        final,
        preamble=preamble,
    )


def plan_completion(
    request: Request, ctx: ServerContext, body: CompletionRequest
) -> tuple[str, ClientRequest]:
    """A completion request checked and made ready for the engine: (model, the request)."""
    model = check_model(ctx, body.model)
    body.check_supported()
    prompt = body.prompt_value()
    if isinstance(prompt, str):
        check_text("prompt", prompt)
    check_text("stop", *body.stop_list())
    fim = None
    if body.suffix is not None:  # fill in the middle: the prompt is the text before the hole
        check_text("suffix", body.suffix)
        fim = FimRequest(prefix=str(prompt), suffix=body.suffix, param="suffix")
    size = len(prompt) if isinstance(prompt, str) else len(prompt) * 4
    check_prompt_size(ctx, size + len(body.suffix or ""))
    req = ClientRequest(
        prompt=prompt,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        fim=fim,
        **structured_output(body),
        **_sampling(body),
        model=model,
    )
    req.cache_partition = request_partition(request, body.cache_salt)
    return model, req


@router.post("/completions", response_model=Completion, responses=STREAM_RESPONSES)
async def completions(request: Request, body: CompletionRequest, ctx: Ctx) -> Any:
    apply_store_defaults(ctx, body)
    model, req = plan_completion(request, ctx, body)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    offset = 0  # characters streamed so far (logprobs' text_offset)

    def chunk(
        text: str | None, finish: str | None, lps: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        nonlocal offset
        logprobs = completion_logprobs(lps, offset) if lps else None
        offset += len(text or "")
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            ],
        }

    def final(gen: Generation) -> dict[str, Any]:
        out = chunk(gen.text, gen.finish_reason)
        if gen.logprobs is not None:
            out["choices"][0]["logprobs"] = completion_logprobs(gen.logprobs, 0)
        out["usage"] = usage(gen)
        out["memspec"] = memspec_stats(gen)
        return out

    if (body.n or 1) > 1:
        return await run_choices(request, ctx, req, body.n or 1, final)
    return await run_request(request, ctx, req, body.stream, body.include_usage(), chunk, final)


# --- llama-server's routes -------------------------------------------------------------------


async def _with_target(ctx: ServerContext, fn: Callable[[Any], Any]) -> Any:
    """fn(target) on a worker thread, between the engine's rounds (a target in another
    process answers one caller at a time)."""
    served_model(ctx)  # NotReady while loading
    w = ctx.worker
    rt = w.targets.runtime(w.default_model)
    if rt is None:  # unloaded (keep_alive, another model's room): the default loads again
        await ctx.control(lambda w: w.load_model(w.default_model), "load the default model")
        rt = w.targets.runtime(w.default_model)
        if rt is None:
            raise NotReady("models are loading; retry shortly", code="model_loading")

    def run() -> Any:
        with rt.lock:
            return fn(rt.target)

    return await asyncio.to_thread(run)


def _piece_json(piece: bytes) -> str | list[int]:
    """llama-server's piece: the text, or its bytes when they are not valid UTF-8 alone."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


@llama_router.post("/tokenize")
async def tokenize(body: TokenizeRequest, ctx: Ctx) -> dict[str, Any]:
    check_text("content", body.content)
    check_prompt_size(ctx, len(body.content))

    def run(target: Any) -> dict[str, Any]:
        ids = target.tokenize(body.content, add_bos=body.add_special, special=body.parse_special)
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": _piece_json(target.detokenize([t]))} for t in ids]}

    return await _with_target(ctx, run)


@llama_router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Ctx) -> dict[str, Any]:
    def run(target: Any) -> dict[str, Any]:
        bad = next((t for t in body.tokens if t >= target.n_vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (0..{target.n_vocab - 1})",
                param="tokens",
            )
        return {"content": target.detokenize(body.tokens).decode("utf-8", errors="replace")}

    return await _with_target(ctx, run)


@llama_router.post("/infill", responses=STREAM_RESPONSES)
async def infill(request: Request, body: InfillRequest, ctx: Ctx) -> Any:
    """llama-server's fill-in-the-middle: input_prefix, input_suffix, input_extra (other files
    of the project) and prompt (the start of the middle); its /completion answer shape."""
    model = served_model(ctx) if body.model is None else check_model(ctx, body.model)
    body.check_supported()
    if (body.n or 1) != 1:
        raise InvalidRequest("/infill fills one middle: n must be 1", param="n")
    texts = [body.input_prefix, body.input_suffix, body.prompt]
    texts += [t for e in body.input_extra for t in (e.filename, e.text)]
    check_text("input_prefix", *texts)
    check_text("stop", *body.stop_list())
    check_prompt_size(ctx, sum(len(t) for t in texts))
    fim = FimRequest(
        prefix=body.input_prefix,
        suffix=body.input_suffix,
        middle=body.prompt,
        extra=[(e.filename, e.text) for e in body.input_extra],
        param="input_suffix",
    )
    req = ClientRequest(
        fim=fim,
        max_tokens=body.max_tokens,
        **structured_output(body),
        **_sampling(body),
        model=model,
    )
    req.cache_partition = request_partition(request, body.cache_salt)

    def chunk(
        text: str | None, finish: str | None, lps: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        return {"index": 0, "content": text or "", "stop": finish is not None}

    def final(gen: Generation) -> dict[str, Any]:
        prompt_ms = gen.ttft_s * 1000
        predicted_ms = max(0.0, gen.elapsed_s * 1000 - prompt_ms)
        return {
            "index": 0,
            "content": gen.text,
            "stop": True,
            "model": model,
            "id_slot": 0,
            "stop_type": "limit" if gen.finish_reason == "length" else "eos",
            "stopping_word": "",
            "truncated": False,
            "tokens_predicted": gen.completion_tokens,
            "tokens_evaluated": gen.prompt_tokens,
            "tokens_cached": gen.cached_tokens,
            "timings": {
                "prompt_n": gen.prompt_tokens - gen.cached_tokens,
                "prompt_ms": round(prompt_ms, 3),
                "predicted_n": gen.completion_tokens,
                "predicted_ms": round(predicted_ms, 3),
                "predicted_per_second": round(gen.tokens_per_s, 3),
                "draft_n": gen.proposed,
                "draft_n_accepted": gen.accepted,
            },
            "memspec": memspec_stats(gen),
        }

    def last(gen: Generation) -> dict[str, Any]:
        out = final(gen)
        out["content"] = ""  # the text went out in the chunks
        return out

    return await run_request(
        request, ctx, req, body.stream, False, chunk, final, last=last, done_marker=False
    )
