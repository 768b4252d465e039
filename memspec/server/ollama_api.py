"""Ollama's API on the same port as /v1: what Open WebUI, LiteLLM, editors and the `ollama`
client speak (docs/ollama.md has the route table).

Each request is translated into the OpenAI body it means and planned by the same code
(openai_api.plan_chat / plan_completion), so tools, structured output, limits and the lossless
engine are the same; only the wire differs: NDJSON streams (Ollama's default), `{"error": ...}`
bodies (server/errors.py shapes them for /api/*), counters in nanoseconds. An Ollama option
that would change the output and that this daemon cannot honour is a 400 naming it, never
ignored; a null option is an option not set; a hardware hint (num_thread, num_gpu, ...) is the
daemon's settings' business: accepted, logged and reported in X-Memspec-Ignored-Options. A
model name is checked as Ollama checks it (memspec.ollama_name) before any lookup.

A model of an Ollama-layout store (memspec.catalog: memspec's own, or the adopted Ollama store)
brings its defaults as Ollama applies them: its `.params` options under the request's own, its
`.system` prompt when the request has no system message of its own, its `.messages` before the
conversation; /api/tags and /api/ps list it with its manifest's digest, /api/show with its
system prompt, license, parameters and messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import memspec
from memspec import ollama_name
from memspec.catalog import ServableModel
from memspec.drafts.family import FTYPE_NAMES
from memspec.engine.speculative import Generation
from memspec.errors import InvalidRequest, MemSpecError, UnknownModel
from memspec.files import recorded_sha256, sha256_file
from memspec.memory.gguf_info import read_shape
from memspec.request_check import ClientRequest
from memspec.server import tools
from memspec.server.auth import require_api_key
from memspec.server.context import Ctx, ServerContext
from memspec.server.openai_api import (
    chat_template,
    check_model,
    memspec_stats,
    plan_chat,
    plan_completion,
    run_request,
    served_model,
)
from memspec.server.openai_schema import ChatCompletionRequest, CompletionRequest
from memspec.store_model import StoreModel
from memspec.units import MAX_DURATION_S, parse_duration_s

log = logging.getLogger("memspec.server")

# Ollama's routes need the same key as /v1 when keys are set; `/` and /api/version do not
# (Ollama's clients probe them before anything else).
router = APIRouter(tags=["ollama"], dependencies=[Depends(require_api_key)])
open_router = APIRouter(tags=["ollama"])

OLLAMA_VERSION = "0.6.8"  # the API level these routes follow (what clients feature-check)

# Ollama's documented defaults when a request sets no option (docs/ollama.md).
DEFAULT_OPTIONS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

# Ollama option -> the OpenAI-body field it becomes. Every other option is a 400 naming it.
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Ollama's hardware and loading hints: how the model is run, not what it answers. This daemon's
# settings decide those (n_threads, n_gpu_layers, ...), once for every client; clients such as
# langchain-ollama send them on every request (num_thread: 2), so they are accepted, logged and
# named in this response header rather than refused.
HARDWARE_OPTIONS = frozenset(
    {
        "num_thread", "num_gpu", "main_gpu", "num_batch", "use_mmap", "numa", "low_vram",
        "use_mlock", "f16_kv", "vocab_only", "logits_all",
    }
)  # fmt: skip
IGNORED_HEADER = "X-Memspec-Ignored-Options"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # checked by memspec.ollama_name (length included)
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    draft: str | None = None  # MemSpec's extension, as on /v1: a draft id, "none" or "auto"


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ChatBody(_Body):
    messages: Annotated[list[OllamaMessage], Field(max_length=4096)] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Body):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    name: str | None = None  # the older field name
    verbose: bool = False


# --- translation ---------------------------------------------------------------------------


def _parse(cls: type[BaseModel], raw: Any) -> Any:
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        if first.get("type") == "extra_forbidden":
            raise InvalidRequest(f"{where} is not supported by this server", param=where) from None
        raise InvalidRequest(
            f"invalid value for {where}: {first.get('msg')}", param=where
        ) from None


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None


def _keep_alive_s(value: str | int | float | None) -> float | None:
    """Ollama's keep_alive in seconds (memspec.units.parse_duration_s); None if not given.
    Negative, or beyond MAX_DURATION_S (100 years, infinity included): -1, no expiry; NaN or a
    text that is no duration: a 400, before anything runs."""
    if value is None:
        return None
    try:
        return parse_duration_s(value)
    except ValueError as e:
        raise InvalidRequest(f"keep_alive: {e}"[:200], param="keep_alive") from None


def model_name(asked: str | None) -> str | None:
    """The name a request's `model` asks the catalog for: Ollama's rules checked first (an
    invalid name is a 400 before any lookup), a default host and namespace dropped
    (`library/smollm2:135m` is `smollm2:135m`); None or "" (the default model) as it is."""
    parsed = ollama_name.check(asked)
    return asked if parsed is None else parsed.local


_logged_ignored: set[frozenset[str]] = set()


def split_options(options: dict[str, Any] | None, route: str) -> tuple[dict[str, Any], list[str]]:
    """A request's options as (those set, the hardware hints ignored). A null option is one
    not set (langchain-ollama sends every option, the unset ones as null); a hardware hint is
    accepted and reported, logged once per set of names (clients send them on every request)."""
    given = {k: v for k, v in (options or {}).items() if v is not None}
    ignored = sorted(k for k in given if k in HARDWARE_OPTIONS)
    if ignored and (key := frozenset(ignored)) not in _logged_ignored:
        _logged_ignored.add(key)
        log.info(
            "%s: ignoring Ollama options %s (the daemon's settings decide how models run); "
            "logged once for these names",
            route,
            ", ".join(ignored),
        )
    return {k: v for k, v in given.items() if k not in HARDWARE_OPTIONS}, ignored


def with_ignored(result: Any, ignored: list[str]) -> Any:
    """The answer, with X-Memspec-Ignored-Options naming the hardware hints left aside."""
    if not ignored:
        return result
    value = ",".join(ignored)
    if isinstance(result, Response):
        result.headers[IGNORED_HEADER] = value
        return result
    return JSONResponse(result, headers={IGNORED_HEADER: value})


def _check_common(body: _Body, route: str) -> list[str]:
    """What every generation route checks before any lookup: the model's name, think,
    keep_alive; body.options keeps the options set (null ones and hardware hints dropped).
    Returns the hardware hints ignored."""
    body.model = model_name(body.model)
    if body.think:
        raise InvalidRequest(
            "think is not supported: the served model has no thinking mode", param="think"
        )
    _keep_alive_s(body.keep_alive)  # a malformed duration is a 400 before anything runs
    body.options, ignored = split_options(body.options, route)
    return ignored


def _sampling(body: _Body, n_ctx: int) -> dict[str, Any]:
    """The OpenAI-body fields Ollama's options and format mean (and MemSpec's `draft`);
    body.options as _check_common left it."""
    options = {**DEFAULT_OPTIONS, **(body.options or {})}
    out: dict[str, Any] = {} if body.draft is None else {"draft": body.draft}
    for name, value in options.items():
        if name == "num_ctx":
            if not isinstance(value, int) or isinstance(value, bool) or value > n_ctx:
                raise InvalidRequest(
                    f"options.num_ctx {value!r}: this daemon runs a {n_ctx}-token context "
                    "(set n_ctx when starting it); a request may ask for it or less",
                    param="options.num_ctx",
                )
            continue
        field = OPTION_FIELDS.get(name)
        if field is None:
            raise InvalidRequest(
                f"options.{name} is not supported by this server (docs/ollama.md lists the "
                "options it honours)",
                param=f"options.{name}",
            )
        if name == "num_predict" and isinstance(value, int) and value in (-1, -2):
            continue  # Ollama's "until the end" / "fill the context": our default
        if name == "stop" and isinstance(value, str):
            value = [value]
        out[field] = value
    if body.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": body.format},
        }
    elif body.format not in (None, ""):
        raise InvalidRequest(
            f'format {body.format!r}: use "json" or a JSON schema object', param="format"
        )
    return out


def _openai_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    call_ids: list[str] = []  # Ollama's tool results answer the calls before them, in order
    for i, m in enumerate(messages):
        if m.images:
            raise InvalidRequest(
                "images are not supported: the served model reads text only",
                param=f"messages.{i}.images",
            )
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function") or {}
                args = fn.get("arguments", {})
                call_id = f"call_{i}_{j}"
                call_ids.append(call_id)
                msg["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": fn.get("name", ""),
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                )
        if m.role == "tool":
            msg["tool_call_id"] = call_ids.pop(0) if call_ids else f"call_{i}"
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def _ollama_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    out = []
    for c in calls:
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except (TypeError, ValueError):
            args = fn["arguments"]
        out.append({"function": {"name": fn["name"], "arguments": args}})
    return out


# --- answers -------------------------------------------------------------------------------


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def _now() -> str:
    return _iso(datetime.now(timezone.utc))


def _ndjson(obj: dict[str, Any] | str) -> str:
    return (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n"


def _error_event(exc: MemSpecError) -> dict[str, Any]:
    return {"error": exc.message}


def counters(gen: Generation, done_reason: str) -> dict[str, Any]:
    """The last object's fields: why it ended, Ollama's counters (ns), and `memspec`."""
    ns = 1_000_000_000
    return {
        "done": True,
        "done_reason": done_reason,
        "total_duration": int(gen.elapsed_s * ns),
        "load_duration": int(gen.stall_s * ns),  # waiting for a model to load
        "prompt_eval_count": gen.prompt_tokens,
        "prompt_eval_duration": int(gen.ttft_s * ns),
        "eval_count": gen.completion_tokens,
        "eval_duration": int(max(0.0, gen.elapsed_s - gen.ttft_s) * ns),
        "memspec": memspec_stats(gen),
    }


def _reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"


async def _load_or_unload(
    ctx: ServerContext, model: str, keep_alive: str | int | float | None, key: str, empty: Any
) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate: with keep_alive 0 the model is
    unloaded, else it is loaded (and stays for keep_alive)."""
    keep = _keep_alive_s(keep_alive)
    if keep == 0:
        await ctx.control(lambda w: w.unload_model(model), f"unload {model}")
        reason = "unload"
    else:
        await ctx.control(lambda w: w.load_model(model, keep), f"load {model}")
        reason = "load"
    return {"model": model, "created_at": _now(), key: empty, "done": True, "done_reason": reason}


def _keep(req: ClientRequest, keep_alive: str | int | float | None) -> ClientRequest:
    req.keep_alive_s = _keep_alive_s(keep_alive)
    return req


@router.post("/api/chat")
async def chat(request: Request, ctx: Ctx) -> Any:
    body: ChatBody = _parse(ChatBody, await _json(request))
    ignored = _check_common(body, "/api/chat")
    if not body.messages:
        empty = {"role": "assistant", "content": ""}
        loaded = await _load_or_unload(
            ctx, check_model(ctx, body.model), body.keep_alive, "message", empty
        )
        return with_ignored(loaded, ignored)
    entry = _store_model(ctx, body.model)
    messages = _openai_messages(body.messages)
    if entry is not None:  # the model's defaults, as Ollama's ChatHandler applies them
        _model_options(body, entry, ctx.n_ctx)
        messages = [dict(m) for m in entry.messages] + messages
        if entry.system and body.messages[0].role != "system":
            messages.insert(0, {"role": "system", "content": entry.system})
    oa = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        **_sampling(body, ctx.n_ctx),
    }
    if body.tools:
        oa["tools"] = body.tools
    model, plan, req = plan_chat(request, ctx, _parse(ChatCompletionRequest, oa))
    # With tools, text that may open a call is held back until it does or cannot (the same
    # splitter as /v1's streams); the rest streams as it comes, as Ollama streams it. Calls
    # go out whole, parsed from the answer, in the last object.
    tool_stream = plan.stream() if body.stream else None

    def chunk(text: str | None, finish: str | None, _lps: Any = None) -> dict[str, Any]:
        delta, _ = tools.stream_delta(tool_stream, text, finish)
        return {
            "model": model,
            "created_at": _now(),
            "message": {"role": "assistant", "content": delta.get("content", "")},
            "done": False,
        }

    def final(gen: Generation) -> dict[str, Any]:
        message, _ = plan.answer(gen.text, gen.finish_reason)
        out_msg: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            out_msg["tool_calls"] = _ollama_tool_calls(message["tool_calls"])
        out = {"model": model, "created_at": _now(), "message": out_msg}
        return out | counters(gen, _reason(gen.finish_reason))

    def last(gen: Generation) -> dict[str, Any]:
        out = final(gen)
        # The streamed text went out in the chunks; what the splitter still holds goes here.
        held, _ = tools.stream_delta(tool_stream, None, gen.finish_reason)
        out["message"]["content"] = held.get("content", "")
        return out

    answer = await _run(request, ctx, _keep(req, body.keep_alive), body.stream, chunk, final, last)
    return with_ignored(answer, ignored)


@router.post("/api/generate")
async def generate(request: Request, ctx: Ctx) -> Any:
    body: GenerateBody = _parse(GenerateBody, await _json(request))
    ignored = _check_common(body, "/api/generate")
    if body.images:
        raise InvalidRequest(
            "images are not supported: the served model reads text only", param="images"
        )
    if body.context:
        raise InvalidRequest(
            "context is not supported (deprecated in Ollama): send the conversation to /api/chat",
            param="context",
        )
    if body.template is not None:
        raise InvalidRequest(
            "template is not supported: the target's own chat template is used (or raw: true)",
            param="template",
        )
    if not body.prompt and body.suffix is None:
        model = check_model(ctx, body.model)
        loaded = await _load_or_unload(ctx, model, body.keep_alive, "response", "")
        return with_ignored(loaded, ignored)
    entry = _store_model(ctx, body.model)
    if entry is not None:
        _model_options(body, entry, ctx.n_ctx)
    sampling = _sampling(body, ctx.n_ctx)
    if body.raw or body.suffix is not None:  # the prompt as it is, or the text before a hole
        if body.system is not None:
            raise InvalidRequest(
                "system needs the chat template: drop raw or suffix", param="system"
            )
        oa = {"model": body.model, "prompt": body.prompt, "stream": body.stream, **sampling}
        oa["max_tokens"] = sampling.get("max_tokens")
        if body.suffix is not None:
            oa["suffix"] = body.suffix
        model, req = plan_completion(request, ctx, _parse(CompletionRequest, oa))
    else:
        # As Ollama's GenerateHandler: the request's system, else the model's; then the
        # model's messages; then the prompt.
        system = body.system or (entry.system if entry is not None else None)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [dict(m) for m in entry.messages] if entry is not None else []
        messages.append({"role": "user", "content": body.prompt})
        oa = {"model": body.model, "messages": messages, "stream": body.stream, **sampling}
        model, _, req = plan_chat(request, ctx, _parse(ChatCompletionRequest, oa))

    def chunk(text: str | None, finish: str | None, _lps: Any = None) -> dict[str, Any]:
        return {"model": model, "created_at": _now(), "response": text or "", "done": False}

    def final(gen: Generation) -> dict[str, Any]:
        out = {"model": model, "created_at": _now(), "response": gen.text}
        return out | counters(gen, _reason(gen.finish_reason))

    def last(gen: Generation) -> dict[str, Any]:
        return final(gen) | {"response": ""}

    answer = await _run(request, ctx, _keep(req, body.keep_alive), body.stream, chunk, final, last)
    return with_ignored(answer, ignored)


def _store_model(ctx: ServerContext, name: str | None) -> StoreModel | None:
    """The store model a request names (its layers' defaults apply); None for a loose file,
    the default target, or a name the catalog does not serve (planning then says why)."""
    if not name:
        return None
    found = ctx.worker.catalog.find(name)
    return found.store if found is not None else None


# A model's .params may spell out an option at the value that turns it off (`PARAMETER
# mirostat 0`): that changes nothing, so it is no reason to refuse the model.
NEUTRAL_OPTIONS: dict[str, float] = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}


def _model_options(body: _Body, entry: StoreModel, n_ctx: int) -> None:
    """body.options over the model's `.params` defaults (the request's own win)."""
    body.options = {**store_options(entry), **(body.options or {})}


def store_options(entry: StoreModel) -> dict[str, Any]:
    """The options a store model's `.params` sets that this daemon applies (/v1 applies them
    too: memspec/server/openai_api.py). The model's hardware hints are the daemon's business
    (dropped, as a request's are); its num_ctx is a wish this daemon's context may not meet
    (dropped); an option at the value that turns it off is dropped; any other option that would
    change the output and is not implemented refuses the request, naming the model's layer."""
    defaults: dict[str, Any] = {}
    for key, value in entry.options.items():
        if value is None or key in HARDWARE_OPTIONS:
            continue
        if key == "num_ctx":
            continue  # the daemon's context serves it (a request's own num_ctx is checked)
        if key in NEUTRAL_OPTIONS and value == NEUTRAL_OPTIONS[key]:
            continue
        if key not in OPTION_FIELDS:
            raise InvalidRequest(
                f"model {entry.name.display} sets the option {key!r} in its .params layer, "
                "which this server does not implement (docs/ollama.md lists the options it "
                "honours)",
                param="model",
            )
        defaults[key] = value
    return defaults


async def _run(
    request: Request, ctx: ServerContext, req: Any, stream: bool, chunk: Any, final: Any, last: Any
) -> Any:
    return await run_request(
        request,
        ctx,
        req,
        stream,
        False,
        chunk,
        final,
        last=last,
        done_marker=False,
        frame=_ndjson,
        error_event=_error_event,
        media_type="application/x-ndjson",
    )


# --- models ---------------------------------------------------------------------------------

_digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256 hex


def file_digest(path: Path) -> str:
    """The file's SHA-256 (Ollama's digest): the fetch's check remembered beside it when it
    is for the file as it is now, else hashed once per file version."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        _digests[key] = recorded_sha256(path) or sha256_file(path)
    return _digests[key]


def _find_model(ctx: ServerContext, name: str, *, refused: bool = False) -> ServableModel:
    found = ctx.worker.catalog.find(name, refused=refused)
    if found is None:
        raise UnknownModel(f"model {name!r} not found", param="model")
    return found


def _header_fields(path: Path) -> dict[str, Any]:
    """The GGUF's metadata as Ollama's model_info: scalars as they are, arrays left out
    (Ollama sends them only with verbose)."""
    from gguf import GGUFValueType

    from memspec.drafts.gguf_header import open_header, scalar

    reader = open_header(path)
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or (f.types and f.types[0] == GGUFValueType.ARRAY):
            continue
        out[key] = scalar(reader, key)
    return out


def _details(path: Path, info: dict[str, Any]) -> dict[str, Any]:
    shape = read_shape(path)
    main_type = max(shape.bytes_by_type, key=lambda t: shape.bytes_by_type[t], default="")
    # The file's type as Ollama reports it (general.file_type: Q4_K_M), else the type most
    # of the weight bytes have (a file written without general.file_type).
    file_type = info.get("general.file_type")
    if isinstance(file_type, int) and file_type in FTYPE_NAMES:
        main_type = FTYPE_NAMES[file_type]
    size_label = info.get("general.size_label")
    if not size_label:
        n = shape.weight_bytes  # bytes, not parameters: only a fallback label
        size_label = f"{n / 1e9:.1f}GB"
    return {
        "parent_model": "",
        "format": "gguf",
        "family": shape.arch,
        "families": [shape.arch],
        "parameter_size": str(size_label),
        "quantization_level": str(main_type).upper(),
    }


def _modified_at(path: Path) -> str:
    return _iso(datetime.fromtimestamp(path.stat().st_mtime, timezone.utc))


async def _model_row(ctx: ServerContext, model: ServableModel) -> dict[str, Any]:
    path, entry = model.path, model.store

    def read() -> dict[str, Any]:
        info = _header_fields(path)
        if entry is None:  # a loose file: its own hash, size and time
            digest, size, modified = file_digest(path), path.stat().st_size, _modified_at(path)
        else:  # a store model: as Ollama lists it, by its manifest
            digest = entry.digest.removeprefix("sha256:")
            size = entry.manifest.size
            modified = _iso(datetime.fromtimestamp(entry.modified, timezone.utc))
        return {
            "name": model.name,
            "model": model.name,
            "modified_at": modified,
            "size": size,
            "digest": digest,
            "details": _details(path, info),
        }

    return await asyncio.to_thread(read)


@router.get("/api/tags")
async def tags(ctx: Ctx) -> dict[str, Any]:
    """Every model this daemon serves (memspec.catalog), the default target first."""
    served_model(ctx)  # NotReady while loading
    models = await asyncio.to_thread(ctx.worker.catalog.models)
    return {"models": [await _model_row(ctx, m) for m in models]}


# Ollama's expiry for a model loaded with keep_alive -1 (no expiry).
NEVER_EXPIRES = "2318-01-01T00:00:00Z"


def expires_at(expires: float | None) -> str:
    """A resident model's expiry (unix seconds; None: none) as /api/ps writes it. keep_alive is
    bounded (memspec.units.MAX_DURATION_S), but an expiry is written as no expiry whenever it
    is not a date datetime can hold, so /api/ps can never fail on one."""
    if expires is None or not math.isfinite(expires) or expires > time.time() + MAX_DURATION_S:
        return NEVER_EXPIRES
    try:
        return _iso(datetime.fromtimestamp(expires, timezone.utc))
    except (OverflowError, OSError, ValueError):  # out of the platform's or datetime's range
        return NEVER_EXPIRES


@router.get("/api/ps")
async def ps(ctx: Ctx) -> dict[str, Any]:
    """The resident models: their bytes as the budget counts them, and when they expire."""
    served_model(ctx)
    rows = []
    for m in await asyncio.to_thread(ctx.worker.models_status):
        if not m["resident"]:
            continue
        model = ctx.worker.catalog.find(m["name"], refused=True)
        if model is None:  # its file or manifest left while it was resident: not described
            continue
        row = await _model_row(ctx, model)
        row["size"] = m["bytes"]  # target + resident drafts + KV, as the budget counts
        row["size_vram"] = 0 if ctx.settings.n_gpu_layers == 0 else row["size"]
        row["expires_at"] = expires_at(m["expires_at"])
        row["context_length"] = m.get("n_ctx") or ctx.n_ctx
        rows.append(row)
    return {"models": rows}


def _has_fim_tokens(path: Path) -> bool:
    """Whether a model that is not loaded has FIM tokens (its vocabulary names them)."""
    from memspec.drafts.gguf_header import array_bytes, open_header

    raw = array_bytes(open_header(path), "tokenizer.ggml.tokens") or b""
    return any(t in raw for t in (b"fim_prefix", b"fim_pre>", b"<PRE>"))


def _parameters_text(entry: StoreModel | None) -> str:
    """Ollama's `parameters`: a store model's own options (as Ollama writes them: one line
    per value, a list's values each on a line); else the defaults this daemon applies."""
    if entry is None:
        return "\n".join(f"{k:<15}{v}" for k, v in DEFAULT_OPTIONS.items())
    lines = []
    for key, value in entry.options.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"{key:<30} {json.dumps(v)}")
    return "\n".join(lines)


def _modelfile(model: ServableModel) -> str:
    """A Modelfile that says what the model is (Ollama's `modelfile` field)."""
    entry = model.store
    if entry is None:
        return f"FROM {model.path}\n"
    lines = [f"# Modelfile of {model.name} ({'the Ollama store' if entry.adopted else 'memspec'})"]
    lines.append(f"FROM {model.path}")
    if entry.template is not None:
        lines.append("# TEMPLATE (a Go template) not executed: chats use the GGUF's own")
    if entry.system:
        lines.append(f"SYSTEM {json.dumps(entry.system)}")
    for key, value in entry.options.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {key} {json.dumps(v)}")
    for m in entry.messages:
        lines.append(f"MESSAGE {m['role']} {json.dumps(m['content'])}")
    for text in entry.license:
        lines.append(f"LICENSE {json.dumps(text)}")
    return "\n".join(lines) + "\n"


@router.post("/api/show")
async def show(request: Request, ctx: Ctx) -> dict[str, Any]:
    body: ShowBody = _parse(ShowBody, await _json(request))
    if body.verbose:  # Ollama then adds the GGUF's arrays (150k-token vocabularies): not sent
        raise InvalidRequest(
            "verbose is not supported: model_info holds the GGUF's scalar metadata only",
            param="verbose",
        )
    asked = model_name(body.model or body.name)
    if not asked:
        raise InvalidRequest("model is required", param="model")
    # A refused store model (a projector, an adapter) is shown, saying why it is not served.
    found = ctx.worker.catalog.find(asked, refused=True) if asked != served_model(ctx) else None
    if found is not None and found.refused:
        model, name = found, found.name
    else:
        name = check_model(ctx, asked)
        model = _find_model(ctx, name)
    path, entry = model.path, model.store
    rt = ctx.worker.targets.runtime(name)
    info = await asyncio.to_thread(_header_fields, path)
    template = (
        ctx.worker.catalog.chat_template(model) if model.refused else chat_template(ctx, name)
    )
    # Tools work on every target: a template without a place for them gets them described in
    # a system message (server/tools.py), so Open WebUI's and editors' tools are not refused.
    # Embeddings too: the target serves them unless embedding_model names another model.
    capabilities = ["completion", "tools"]
    fim = rt.requests.fim_tokens is not None if rt is not None else _has_fim_tokens(path)
    if fim:
        capabilities.append("insert")
    if not ctx.settings.embedding_model and name == ctx.worker.default_model:
        capabilities.append("embedding")
    template_text = template.jinja or template.builtin or ""
    out: dict[str, Any] = {
        "modelfile": _modelfile(model),
        "parameters": _parameters_text(entry),
        "template": template_text,
        "details": _details(path, info),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": _modified_at(path),
        "license": str(info.get("general.license", "")),
    }
    if entry is not None:
        out["modified_at"] = _iso(datetime.fromtimestamp(entry.modified, timezone.utc))
        out["license"] = "\n".join(entry.license) or out["license"]
        if entry.system:
            out["system"] = entry.system
        if entry.messages:
            out["messages"] = [dict(m) for m in entry.messages]
        # What memspec makes of the layers: the template it runs, what is not used, why a
        # model is refused.
        out["memspec"] = {
            "store": "ollama" if entry.adopted else "memspec",
            "digest": entry.digest,
            "template": "the GGUF's own chat template (the model's TEMPLATE layer, a Go "
            "template, is not executed)"
            if entry.template is not None
            else "the GGUF's own chat template",
            "notes": list(entry.notes),
            "refused": model.refused,
        }
    if ctx.draft_builds is not None:  # the drafts it has, and its family's build (or failure)
        drafts = await asyncio.to_thread(ctx.draft_builds.of, model)
        out.setdefault("memspec", {})["drafts"] = drafts
    return out


# --- liveness (no key, as Ollama's clients probe them first) --------------------------------


@open_router.get("/", response_class=PlainTextResponse)
async def root() -> str:
    return "Ollama is running"


@open_router.head("/")
async def root_head() -> Response:
    return Response(media_type="text/plain; charset=utf-8")


@open_router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION, "memspec": memspec.__version__}
