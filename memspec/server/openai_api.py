"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

HTTP-level checks run here (model, fields, text, size); the engine thread checks the request
against the models once (Runtime.request) and answers once it has produced its first event,
so errors found before any token (unknown draft, prompt over the context) get their own
status even for a stream. Streams are SSE: `data: {chunk}` per text delta, a last chunk with
finish_reason (and `memspec`), a usage chunk when asked for, then `data: [DONE]`. A client
that disconnects, queued or streaming, cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

import memspec
from memspec.engine.speculative import Generation
from memspec.errors import DeviceUnavailable, InvalidRequest
from memspec.runtime import ClientRequest
from memspec.server.auth import request_partition, require_api_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.errors import NotReady, UnknownModel, as_memspec_error, error_json
from memspec.server.openai_schema import (
    ERROR_RESPONSES,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from memspec.server.worker import Done, Event, Failed, GenerateJob, Token

router = APIRouter(
    prefix="/v1",
    tags=["openai"],
    dependencies=[Depends(require_api_key)],
    responses=ERROR_RESPONSES,
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
    ks = gen.k_per_round
    return {
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
    }


def served_model(ctx: ServerContext) -> str:
    """The served model id; NotReady until the target has loaded (the id is its metadata's)."""
    model_id = ctx.model_id
    if model_id is None:
        w = ctx.worker
        if w.state == "failed":
            raise NotReady(f"models failed to load: {w.error}", code="model_load_failed")
        if w.state == "waiting_for_device":
            raise DeviceUnavailable(f"the target cannot load: {w.error}")
        raise NotReady("models are loading; retry shortly", code="model_loading")
    return model_id


def check_model(ctx: ServerContext, model: str) -> str:
    """The served id, if `model` names it (or the target file, by name or as configured)."""
    served = served_model(ctx)
    target = ctx.settings.target
    if model not in (served, target, Path(target).name):
        raise UnknownModel(
            f"The model {model!r} does not exist; this server serves {served!r} (see /v1/models)",
            param="model",
        )
    return served


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
    chunk: Callable[[str | None, str | None], dict[str, Any]],
    final: Callable[[Generation], dict[str, Any]],
    preamble: dict[str, Any] | None = None,
) -> Response | dict[str, Any]:
    """Queue the generation; answer JSON (final(gen)) or an SSE stream of chunk(...)s."""
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
        try:
            if preamble is not None:
                yield sse(preamble)
            while True:
                if isinstance(ev, Token):
                    yield sse(chunk(ev.text, None))
                elif isinstance(ev, Done):
                    gen: Generation = ev.result
                    last = chunk(None, gen.finish_reason)
                    last["memspec"] = memspec_stats(gen)
                    yield sse(last)
                    if include_usage:
                        tail = chunk(None, None)
                        tail["choices"] = []
                        tail["usage"] = usage(gen)
                        yield sse(tail)
                    yield sse("[DONE]")
                    return
                else:  # Failed mid-stream: an OpenAI error event, then the end
                    yield sse(error_json(as_memspec_error(ev.error)))
                    yield sse("[DONE]")
                    return
                ev = await job.next_event()
        finally:
            job.cancel.set()  # the client left (or we are done): stop generating now

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    return {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "seed": body.seed,
        "stop": body.stop_list(),
        "draft": body.draft,
        "policy": body.policy,
    }


# --- routes --------------------------------------------------------------------------------


@router.get("/models", response_model=ModelList)
async def list_models(ctx: Ctx) -> ModelList:
    return ModelList(data=[ModelCard(id=served_model(ctx), created=int(ctx.started_at))])


@router.get("/models/{model_id}", response_model=ModelCard)
async def get_model(model_id: str, ctx: Ctx) -> ModelCard:
    return ModelCard(id=check_model(ctx, model_id), created=int(ctx.started_at))


@router.post("/chat/completions", response_model=ChatCompletion, responses=STREAM_RESPONSES)
async def chat_completions(request: Request, body: ChatCompletionRequest, ctx: Ctx) -> Any:
    model = check_model(ctx, body.model)
    body.check_supported()
    messages = body.message_dicts()
    check_text("messages", *(m["content"] for m in messages))
    check_text("stop", *body.stop_list())
    check_prompt_size(ctx, sum(len(m["content"]) for m in messages))
    req = ClientRequest(messages=messages, max_tokens=body.token_limit(), **_sampling(body))
    req.cache_partition = request_partition(request, body.cache_salt)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "delta": {} if text is None else {"content": text},
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
        }

    def final(gen: Generation) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": gen.text},
                    "finish_reason": gen.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": usage(gen),
            "memspec": memspec_stats(gen),
        }

    preamble = chunk(None, None)
    preamble["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    return await run_request(
        request, ctx, req, body.stream, body.include_usage(), chunk, final, preamble=preamble
    )


@router.post("/completions", response_model=Completion, responses=STREAM_RESPONSES)
async def completions(request: Request, body: CompletionRequest, ctx: Ctx) -> Any:
    model = check_model(ctx, body.model)
    body.check_supported()
    prompt = body.prompt_value()
    if isinstance(prompt, str):
        check_text("prompt", prompt)
    check_text("stop", *body.stop_list())
    check_prompt_size(ctx, len(prompt) if isinstance(prompt, str) else len(prompt) * 4)
    req = ClientRequest(prompt=prompt, max_tokens=body.max_tokens, **_sampling(body))
    req.cache_partition = request_partition(request, body.cache_salt)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            ],
        }

    def final(gen: Generation) -> dict[str, Any]:
        out = chunk(gen.text, gen.finish_reason)
        out["usage"] = usage(gen)
        out["memspec"] = memspec_stats(gen)
        return out

    return await run_request(request, ctx, req, body.stream, body.include_usage(), chunk, final)
