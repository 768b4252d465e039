"""OpenAI-shaped errors: every failure answers {"error": {"message", "type", "param", "code"}}.

The core raises typed `MemSpecError`s that know nothing of HTTP; `HTTP_ERRORS` below is the one
place that gives each class its status and OpenAI error type/code. The server adds the errors
only HTTP has (auth, queue full, loading, body too large). FastAPI's own 422 validation shape
and Starlette's {"detail": ...} are replaced here too.
"""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from memspec.errors import (
    BudgetExceeded,
    ContextOverflow,
    DeviceUnavailable,
    DraftIncompatible,
    InvalidRequest,
    LoadAbandoned,
    MemSpecError,
    ModelDoesNotFit,
    ModelLoadError,
    UnknownDraft,
    UnknownModel,
    UnusableModelFile,
)
from memspec.modelfile import ModelfileError
from memspec.ollama_name import InvalidModelName
from memspec.ollama_store import BlobMismatch, StoreReadOnly
from memspec.predictor.model import PredictorError
from memspec.pull import ModelNotFound, PullCancelled, PullError
from memspec.quantize import QuantizeError
from memspec.registry import Unauthorized as RegistryUnauthorized
from memspec.server.state import StateWriteError

log = logging.getLogger("memspec.server")


class Unauthorized(MemSpecError):
    def __init__(self, message: str = "missing or invalid API key (Authorization: Bearer ...)"):
        super().__init__(message)


class PayloadTooLarge(MemSpecError):
    """The request body exceeds the configured limit."""


class Forbidden(MemSpecError):
    """Refused whoever sends it: a Host or Origin this daemon does not serve (no key set)."""


class UnsupportedMediaType(MemSpecError):
    """A state change sent without a JSON body (a plain HTML form can send text/plain)."""


class RequestTimeout(MemSpecError):
    """The client sent its headers or body too slowly."""


class QueueFull(MemSpecError):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(MemSpecError):
    """Models still loading, being reloaded, or the daemon is shutting down."""

    def __init__(self, message: str, code: str = "not_ready", retry_after_s: int = 2):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class EmbeddingsUnavailable(NotReady):
    """The budget cannot hold the embedding context: a 503 with the reason, no Retry-After
    (it frees only when drafts are unpinned or the budget is raised)."""

    def __init__(self, message: str):
        super().__init__(message, code="memory_budget_exceeded")
        self.retry_after_s = None  # type: ignore[assignment]


class EngineError(MemSpecError):
    """The engine raised something that is not a MemSpecError: a clean 500, no traceback."""


class HttpError(NamedTuple):
    status: int
    type: str
    code: str | None


_CLIENT = "invalid_request_error"
_SERVER = "server_error"

# Class -> how HTTP reports it. A class not listed takes its nearest listed base's entry.
HTTP_ERRORS: dict[type[MemSpecError], HttpError] = {
    MemSpecError: HttpError(400, _CLIENT, None),
    InvalidRequest: HttpError(400, _CLIENT, "invalid_request"),
    ContextOverflow: HttpError(400, _CLIENT, "context_length_exceeded"),
    DraftIncompatible: HttpError(400, _CLIENT, "draft_incompatible"),
    Unauthorized: HttpError(401, _CLIENT, "invalid_api_key"),
    Forbidden: HttpError(403, _CLIENT, "forbidden"),
    UnknownDraft: HttpError(404, _CLIENT, "draft_not_found"),
    UnknownModel: HttpError(404, _CLIENT, "model_not_found"),
    RequestTimeout: HttpError(408, _CLIENT, "request_timeout"),
    PayloadTooLarge: HttpError(413, _CLIENT, "request_too_large"),
    UnsupportedMediaType: HttpError(415, _CLIENT, "unsupported_media_type"),
    QueueFull: HttpError(429, "rate_limit_error", "queue_full"),
    UnusableModelFile: HttpError(422, _CLIENT, "model_file_unusable"),
    ModelLoadError: HttpError(500, _SERVER, "model_load_failed"),
    PredictorError: HttpError(500, _SERVER, "predictor_unavailable"),
    EngineError: HttpError(500, _SERVER, "engine_error"),
    NotReady: HttpError(503, _SERVER, "not_ready"),
    EmbeddingsUnavailable: HttpError(503, _SERVER, "memory_budget_exceeded"),
    # Ollama's pull (memspec.pull): its routes shape these as {"error": ...}
    PullError: HttpError(500, _SERVER, "pull_failed"),
    InvalidModelName: HttpError(400, _CLIENT, "invalid_model_name"),
    ModelNotFound: HttpError(404, _CLIENT, "model_not_found"),
    PullCancelled: HttpError(400, _CLIENT, "pull_cancelled"),
    # The registry refused our credentials: not the client's key to this daemon (no 401 here).
    RegistryUnauthorized: HttpError(500, _SERVER, "pull_failed"),
    # The Ollama store, /api/create and /api/blobs (memspec.ollama_store, .modelfile, .quantize)
    BlobMismatch: HttpError(400, _CLIENT, "digest_mismatch"),
    StoreReadOnly: HttpError(400, _CLIENT, "store_read_only"),
    ModelfileError: HttpError(400, _CLIENT, "invalid_modelfile"),
    QuantizeError: HttpError(500, _SERVER, "quantize_failed"),
    DeviceUnavailable: HttpError(503, _SERVER, "device_unavailable"),
    # A load stopped because its clients left: nobody gets it, but it has its own entry.
    LoadAbandoned: HttpError(503, _SERVER, "load_abandoned"),
    ModelDoesNotFit: HttpError(503, _SERVER, "model_does_not_fit"),
    BudgetExceeded: HttpError(507, _SERVER, "memory_budget_exceeded"),
    StateWriteError: HttpError(507, _SERVER, "state_not_persisted"),
}


def http_error(exc: MemSpecError) -> HttpError:
    """The status, OpenAI type and code that answer `exc` (its own code wins over the class's)."""
    mapped = next(HTTP_ERRORS[c] for c in type(exc).__mro__ if c in HTTP_ERRORS)
    return mapped._replace(code=exc.code) if exc.code is not None else mapped


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(exc: MemSpecError) -> dict[str, Any]:
    mapped = http_error(exc)
    return error_body(exc.message, mapped.type, exc.param, mapped.code)


def error_response(exc: MemSpecError) -> JSONResponse:
    status = http_error(exc).status
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_json(exc), status_code=status, headers=headers)


def as_memspec_error(exc: BaseException) -> MemSpecError:
    """Any exception from the engine, as the error the client sees (no internals leaked)."""
    if isinstance(exc, MemSpecError):
        return exc
    return EngineError(f"the engine failed on this request ({type(exc).__name__}); retry it")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc_param(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content".

    Union members show up in pydantic's locations as type tags ("str", "list[int]",
    "constrained-str"); they are not parameters, so they are left out.
    """
    out = ""
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            out += f"[{p}]"
            continue
        p = str(p)
        if p in _TYPE_TAGS or "[" in p or "-" in p:
            continue
        out += f".{p}" if out else p
    return out or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """One line for the most telling problem: (message, param, code)."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_request_body"
    # With unions every member reports; a type mismatch ("should be a valid string") is the
    # least telling, so a constraint error (too long, out of range, not allowed) wins.
    first = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0])
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", "")
        return f"request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json"
    param = _loc_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if kind == "missing":
        text = f"missing required parameter: {param}" if param else "request body is required"
        return text, param, "missing_required_parameter"
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "request body must be a JSON object", None, "invalid_request_body"
    return f"invalid value for {param or 'body'}: {msg}", param, "invalid_value"


async def _memspec_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MemSpecError)
    status = http_error(exc).status
    if status >= 500:
        log.error("%s %s -> %d %s", request.method, request.url.path, status, exc.message)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param, code = validation_message(exc)
    return JSONResponse(error_body(message, param=param, code=code), status_code=400)


_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


# OpenAI endpoints this daemon knows it does not serve: a 404 that says so, not "no route".
UNSERVED = {
    "/v1/responses": "the Responses API is not served; use /v1/chat/completions",
    "/v1/moderations": "moderation is not served",
    # Ollama's Anthropic and transcription shims: refused by name, not a bare "no route".
    "/v1/messages": "the Anthropic Messages API is not served yet; use /v1/chat/completions",
    "/v1/audio/transcriptions": "audio transcription is not served",
}


def _parse_failure(exc: BaseException) -> tuple[str, str] | None:
    """FastAPI's "error parsing the body" 400, said plainly: (message, code) or None."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8 (byte {cause.start})", "invalid_json"
    if isinstance(cause, RecursionError):
        return "request body is nested too deeply to parse", "invalid_json"
    if isinstance(cause, ValueError):  # e.g. an integer with thousands of digits
        return f"request body is not valid JSON: {cause}"[:300], "invalid_json"
    return None


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    code = _HTTP_CODES.get(exc.status_code)
    if exc.status_code == 400 and (plain := _parse_failure(exc)) is not None:
        detail, code = plain
    elif exc.status_code == 404 and request.url.path in UNSERVED:
        detail = f"{request.url.path} is not served: {UNSERVED[request.url.path]}"
        code = "unsupported_endpoint"
    elif exc.status_code == 404:
        detail = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        detail = f"method {request.method} not allowed on {request.url.path}"
    type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return JSONResponse(
        error_body(detail, type_, code=code),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        error_body("internal server error", "server_error", code="internal_error"),
        status_code=500,
    )


def body_for_path(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error body as the route's API shapes it: Ollama's routes (/api/*) answer
    {"error": "message"}, the only field its clients read; every other route OpenAI's."""
    if not path.startswith("/api/"):
        return body
    err = body.get("error")
    return {"error": err.get("message", "") if isinstance(err, dict) else str(err or body)}


def ollama_shaped(response: JSONResponse) -> JSONResponse:
    """The same error in Ollama's body."""
    body = body_for_path("/api/", json.loads(bytes(response.body)))
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


def _shaped(handler: Any) -> Any:
    """A handler whose answers to Ollama's routes (/api/*) take Ollama's error body."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = await handler(request, exc)
        return ollama_shaped(response) if request.url.path.startswith("/api/") else response

    return handle


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(MemSpecError, _shaped(_memspec_error))
    app.add_exception_handler(RequestValidationError, _shaped(_validation_error))
    app.add_exception_handler(StarletteHTTPException, _shaped(_http_error))
    app.add_exception_handler(Exception, _shaped(_unhandled))
