"""Embeddings: Ollama's POST /api/embed and legacy POST /api/embeddings, OpenAI's POST
/v1/embeddings (docs/api.md, "Embeddings").

All three run on one embedding context (memspec/embeddings.py: llama.cpp's embeddings mode with
the model's own pooling, memspec/backends/embedding.py), loaded by the first request and charged
to the budget; a budget that cannot hold it is a 503 saying so. The work runs on a worker
thread, each chunk between the engine's rounds (under the runtime's lock).

A request is bounded: at most MAX_INPUTS inputs and MAX_TOTAL_TOKENS tokens in all (a 400
naming the limit, the count checked before any input is tokenised), and it stops within one
input of its client hanging up (the thread checks a cancel flag before each input; the route
polls for the disconnect while it waits), as a generation stops between rounds.

What each route returns follows Ollama's server/routes.go: /api/embed L2-normalises every
vector, and `dimensions` keeps the first components and normalises again; the legacy
/api/embeddings returns the model's vector as it comes (EmbeddingsHandler has no normalize:
its runner's raw output). /v1/embeddings answers what /api/embed does in OpenAI's shape, as
Ollama's own /v1 does (its middleware forwards to EmbedHandler).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memspec.backends.embedding import EmbedderClosed, l2_normalize, shorten
from memspec.errors import BudgetExceeded, InvalidRequest
from memspec.model_id import gguf_general_name, model_aliases, served_model_id
from memspec.paths import resolve_model_path
from memspec.runtime import Runtime
from memspec.server.auth import require_api_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.engine_state import state_error
from memspec.server.errors import EmbeddingsUnavailable, EngineError, NotReady
from memspec.server.ollama_api import model_name, split_options, with_ignored
from memspec.server.openai_api import (
    DISCONNECT_POLL_S,
    ClientGone,
    check_model,
    check_prompt_size,
    check_text,
)
from memspec.server.openai_schema import ERROR_RESPONSES
from memspec.units import parse_duration_s

log = logging.getLogger("memspec.server")

router = APIRouter(
    prefix="/v1",
    tags=["openai"],
    dependencies=[Depends(require_api_key)],
    responses=ERROR_RESPONSES,
)
ollama_router = APIRouter(tags=["ollama"], dependencies=[Depends(require_api_key)])

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
# Tokens a request may embed in all: OpenAI's own per-request sum (so a client that batches for
# OpenAI never meets a lower bound here), and never less than one whole embedding context (any
# one input that fits the context is accepted). Each input is bounded by the context already
# (n_ctx, or num_ctx); this bounds the request: 300,000 tokens is minutes of CPU for a small
# model, not hours, and a client that leaves stops it at once. Texts meet max_prompt_chars
# first at the defaults; token-id inputs (no characters to count) and a raised max_body or
# max_prompt_chars meet this.
MAX_TOTAL_TOKENS = 300_000
LONG_REQUEST_INPUTS = 64  # a request with more inputs is logged (its start, and a stop)
# Ollama options that steer sampling: an embedding samples nothing, so they change nothing
# (as in Ollama). num_ctx is honoured; any other option is a 400 naming it.
SAMPLING_OPTIONS = frozenset(
    {
        "temperature", "top_k", "top_p", "min_p", "typical_p", "seed", "stop", "num_predict",
        "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
    }
)  # fmt: skip
TOO_LONG = "the input length exceeds the context length"  # Ollama's words


@dataclass
class Embedded:
    vectors: list[np.ndarray]  # raw, as the model pools them
    prompt_tokens: int
    load_s: float  # setting up the embedding context (0 once it is loaded)
    total_s: float


# --- the shared path -------------------------------------------------------------------------


async def _runtime(ctx: ServerContext) -> Runtime:
    """The default target's runtime, which serves embeddings (on its weights, or on
    settings.embedding_model); loaded first if another model took its place."""
    w = ctx.worker
    if ctx.shutting_down or not w.ready:
        refused = state_error(w.state, w.error)
        raise refused or NotReady("models are loading; retry shortly", code="model_loading")
    rt = w.targets.runtime(w.default_model)
    if rt is None:
        await ctx.control(lambda w: w.load_model(w.default_model), "load the default model")
        rt = w.targets.runtime(w.default_model)
    if rt is None:
        raise NotReady("models are loading; retry shortly", code="model_loading")
    if not rt.embeddings.status()["loaded"]:
        # Set up on the engine thread, which unloads idle models if the budget needs their room.
        try:
            await ctx.control(
                lambda w: w.load_embedder(w.default_model), "set up the embedding context"
            )
        except BudgetExceeded as e:
            raise EmbeddingsUnavailable(f"embeddings are unavailable: {e.message}") from None
    return rt


def embedding_model(ctx: ServerContext, model: str | None) -> str:
    """The name embeddings are answered under, if `model` names the model that serves them
    (settings.embedding_model, by its Ollama name, file or stem) or the target (its served
    name and aliases), or is left out; UnknownModel otherwise."""
    model = model or None  # Ollama's clients send "" for no model
    configured = ctx.settings.embedding_model
    if configured is None:
        return check_model(ctx, model)
    path = resolve_model_path(configured)
    own = served_model_id(None, path)
    if model is None or model in model_aliases(own, gguf_general_name(path), path):
        return own
    check_model(ctx, model)  # the target's names are accepted too; anything else is a 404
    return own


def _check_count(n: int, param: str) -> None:
    """The number of inputs, checked first: 100,000 inputs are refused before any is read."""
    if n > MAX_INPUTS:
        raise InvalidRequest(
            f"{param} has {n} inputs; the limit is {MAX_INPUTS} inputs a request",
            param=param,
            code="too_many_inputs",
        )


def _check_inputs(ctx: ServerContext, texts: list[str], param: str) -> None:
    _check_count(len(texts), param)
    check_text(param, *texts)
    check_prompt_size(ctx, sum(len(t) for t in texts))


def _too_many_tokens(param: str, limit: int) -> InvalidRequest:
    return InvalidRequest(
        f"{param} has more than {limit} tokens in all; the limit is {limit} tokens a request "
        "(send the inputs in several requests)",
        param=param,
        code="too_many_tokens",
    )


async def embed(
    ctx: ServerContext,
    inputs: list[str] | list[list[int]],
    *,
    param: str,
    request: Request | None = None,
    truncate: bool = True,
    limit: int | None = None,
    dimensions: int | None = None,
) -> Embedded:
    """Raw pooled vectors of `inputs` (texts, or token ids used as they are), in order. A text
    longer than the context (or `limit` tokens) is cut at its end when `truncate`, else a 400;
    every input is checked before any is computed; more than MAX_TOTAL_TOKENS in all is a 400.
    `dimensions` beyond the model's: a 400. ClientGone when `request`'s client hangs up: the
    work stops before the next input."""
    _check_count(len(inputs), param)
    rt = await _runtime(ctx)
    cancel = threading.Event()  # set when the client leaves: checked before each input

    def run() -> Embedded:
        t0 = time.perf_counter()
        try:
            emb = rt.embeddings.get()
        except BudgetExceeded as e:
            raise EmbeddingsUnavailable(f"embeddings are unavailable: {e.message}") from None
        except RuntimeError as e:  # unloaded for another model since it was picked
            if rt.working_set is not None:
                raise
            raise NotReady("the model was unloaded; retry shortly", code="model_loading") from e
        t1 = time.perf_counter()
        if dimensions is not None and dimensions > emb.n_embd:
            raise InvalidRequest(
                f"dimensions {dimensions}: this model's embeddings have {emb.n_embd}",
                param="dimensions",
            )
        cap = emb.n_ctx if limit is None else max(1, min(limit, emb.n_ctx))
        most = max(MAX_TOTAL_TOKENS, emb.n_ctx)
        if sum(len(x) for x in inputs if not isinstance(x, str)) > most:
            raise _too_many_tokens(param, most)  # token ids: counted before any is read
        n_vocab = emb.n_vocab
        seqs: list[list[int]] = []
        total = 0
        for i, item in enumerate(inputs):
            if cancel.is_set():  # tokenising 2,000 texts takes a while too
                log.info("embedding stopped: the client left before input %d was read", i)
                raise ClientGone()
            where = f"{param}[{i}]" if len(inputs) > 1 else param
            if isinstance(item, str):
                if not item:
                    raise InvalidRequest(f"{where} is empty", param=param)
                if truncate:
                    try:
                        tokens, _ = emb.fit(item, cap)
                    except ValueError as e:
                        raise InvalidRequest(f"{where}: {e}", param=param) from None
                else:
                    tokens = emb.tokenize(item)
            else:
                tokens = list(item)
                if not tokens:
                    raise InvalidRequest(f"{where} is empty", param=param)
                bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
                if bad is not None:
                    raise InvalidRequest(
                        f"{where}: token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                        param=param,
                    )
            if len(tokens) > cap:
                raise InvalidRequest(
                    f"{TOO_LONG} ({where}: {len(tokens)} tokens, the limit is {cap})",
                    param=param,
                    code="context_length_exceeded",
                )
            total += len(tokens)
            if total > most:  # texts: counted as they are tokenised, the rest left alone
                raise _too_many_tokens(param, most)
            seqs.append(tokens)
        if len(seqs) > LONG_REQUEST_INPUTS:
            log.info("embedding %d inputs (%d tokens)", len(seqs), total)
        vectors = []
        for i, tokens in enumerate(seqs):
            if cancel.is_set():
                log.info("embedding stopped: the client left after %d of %d inputs", i, len(seqs))
                raise ClientGone()
            vectors.append(emb.embed(tokens, rt.lock))
        return Embedded(vectors, total, t1 - t0, time.perf_counter() - t0)

    work = asyncio.ensure_future(asyncio.to_thread(run))
    # Left behind (this coroutine cancelled), its outcome is still read: no asyncio warning.
    work.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
            if done:
                return work.result()
            if request is not None and await request.is_disconnected():
                cancel.set()
                # The thread stops before its next input: wait for it, so that the engine's
                # lock and the CPU are free when this returns.
                await asyncio.wait({work})
                raise ClientGone()
    except EmbedderClosed:
        raise NotReady(
            "the embedding context was released meanwhile (a reload); retry", code="model_loading"
        ) from None
    finally:
        cancel.set()  # however this ends (a 400, a shutdown cancelling it): no more work


def _normalised(vectors: list[np.ndarray], dimensions: int | None) -> list[np.ndarray]:
    try:
        return [shorten(l2_normalize(v), dimensions) for v in vectors]
    except ValueError as e:  # NaN or Inf: the model's output, not the request, is at fault
        raise EngineError(str(e)) from None


def _floats(vec: np.ndarray) -> list[float]:
    return vec.tolist()  # type: ignore[no-any-return]


# --- Ollama ----------------------------------------------------------------------------------


class _OllamaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # checked by memspec.ollama_name (length included)
    keep_alive: str | int | float | None = None
    options: dict[str, Any] | None = None


class EmbedBody(_OllamaBody):
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: int | None = None


class LegacyEmbeddingsBody(_OllamaBody):
    prompt: str = ""


async def _ollama_body(request: Request, cls: type[BaseModel]) -> Any:
    """The body as `cls`, read whatever its content type (Ollama's docs send it with curl -d)."""
    try:
        raw = json.loads(await request.body() or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(
            str(p) for p in first.get("loc", ()) if not str(p).startswith(("str", "list"))
        )
        where = where or "body"
        if first.get("type") == "extra_forbidden":
            raise InvalidRequest(f"{where} is not supported by this server", param=where) from None
        if where.startswith("input"):
            raise InvalidRequest("invalid input type", param="input") from None
        raise InvalidRequest(
            f"invalid value for {where}: {first.get('msg')}", param=where
        ) from None


def _unloads(keep_alive: str | int | float | None) -> bool:
    """Whether Ollama's keep_alive asks to unload after this request (0, "0", "0s"...); a
    malformed one is a 400 (memspec.units.parse_duration_s: the generation routes' rule)."""
    if keep_alive is None:
        return False
    try:
        return parse_duration_s(keep_alive) == 0
    except ValueError:
        raise InvalidRequest(
            f"keep_alive {keep_alive!r} is not a duration"[:200], param="keep_alive"
        ) from None


def _num_ctx(options: dict[str, Any]) -> int | None:
    """Ollama's options for an embedding (null ones and hardware hints already dropped:
    ollama_api.split_options): num_ctx bounds the input's tokens (as in Ollama); sampling
    options change nothing; anything else is refused by name."""
    limit = None
    for name, value in options.items():
        if name == "num_ctx":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(
                    f"options.num_ctx {value!r}: a positive number of tokens",
                    param="options.num_ctx",
                )
            limit = value
        elif name not in SAMPLING_OPTIONS:
            raise InvalidRequest(
                f"options.{name} is not supported by this server for embeddings "
                "(num_ctx is honoured; sampling options change nothing)",
                param=f"options.{name}",
            )
    return limit


async def _release_if(ctx: ServerContext, keep_alive: str | int | float | None) -> None:
    """keep_alive 0: the embedding context is freed and its bytes given back (Ollama unloads)."""
    w = ctx.worker
    if _unloads(keep_alive) and (rt := w.targets.runtime(w.default_model)) is not None:
        await asyncio.to_thread(rt.embeddings.release)


@ollama_router.post("/api/embed")
async def ollama_embed(request: Request, ctx: Ctx) -> Any:
    body: EmbedBody = await _ollama_body(request, EmbedBody)
    asked = model_name(body.model)  # an invalid name is a 400 before any lookup
    options, ignored = split_options(body.options, "/api/embed")
    limit = _num_ctx(options)
    model = embedding_model(ctx, asked)
    _unloads(body.keep_alive)  # a malformed duration is a 400 before anything runs
    if body.dimensions is not None and body.dimensions < 0:
        raise InvalidRequest("dimensions must not be negative", param="dimensions")
    dims = body.dimensions or None  # Ollama: 0 means the model's own
    if isinstance(body.input, str):
        texts = [body.input] if body.input else []  # "": Ollama loads and answers nothing
    else:
        texts = list(body.input or [])
    _check_inputs(ctx, texts, "input")
    try:
        done = await embed(
            ctx, texts, param="input", request=request, truncate=body.truncate, limit=limit
        )
    except ClientGone:
        return Response(status_code=499)
    vectors = _normalised(done.vectors, dims)
    await _release_if(ctx, body.keep_alive)
    ns = 1_000_000_000
    answer = {
        "model": model,
        "embeddings": [_floats(v) for v in vectors],
        "total_duration": int(done.total_s * ns),
        "load_duration": int(done.load_s * ns),
        "prompt_eval_count": done.prompt_tokens,
    }
    return with_ignored(answer, ignored)


@ollama_router.post("/api/embeddings")
async def ollama_embeddings(request: Request, ctx: Ctx) -> Any:
    """Ollama's legacy route: one prompt, the model's vector as it comes (not normalised)."""
    body: LegacyEmbeddingsBody = await _ollama_body(request, LegacyEmbeddingsBody)
    asked = model_name(body.model)
    options, ignored = split_options(body.options, "/api/embeddings")
    limit = _num_ctx(options)
    embedding_model(ctx, asked)
    _unloads(body.keep_alive)
    texts = [body.prompt] if body.prompt else []
    _check_inputs(ctx, texts, "prompt")
    try:
        done = await embed(ctx, texts, param="prompt", request=request, truncate=False, limit=limit)
    except ClientGone:
        return Response(status_code=499)
    await _release_if(ctx, body.keep_alive)
    return with_ignored({"embedding": _floats(done.vectors[0]) if done.vectors else []}, ignored)


# --- OpenAI ----------------------------------------------------------------------------------


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request. `input`: a text, texts, one input as token ids, or several."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: Annotated[str | None, Field(max_length=256)] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int | None, Field(ge=1)] = None
    user: Annotated[str | None, Field(max_length=256)] = None  # accepted, not used


def _base64(vec: np.ndarray) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")


@router.post("/embeddings")
async def openai_embeddings(request: Request, body: EmbeddingRequest, ctx: Ctx) -> Any:
    model = embedding_model(ctx, body.model)
    raw = body.input
    inputs: list[str] | list[list[int]]
    if isinstance(raw, str):
        inputs = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        inputs = [list(raw)]  # type: ignore[arg-type]
    else:
        inputs = list(raw)  # type: ignore[arg-type]
    if not inputs:
        raise InvalidRequest("input is empty: send a text, texts or token ids", param="input")
    _check_count(len(inputs), "input")
    texts = [x for x in inputs if isinstance(x, str)]
    _check_inputs(ctx, texts, "input")
    try:
        done = await embed(ctx, inputs, param="input", request=request, dimensions=body.dimensions)
    except ClientGone:
        return Response(status_code=499)
    vectors = _normalised(done.vectors, body.dimensions)
    encode = _base64 if body.encoding_format == "base64" else _floats
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens},
    }
