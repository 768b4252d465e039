"""Core errors carry no HTTP knowledge; server/errors.py maps every one to a status and body."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

import memspec
from memspec.errors import (
    BudgetExceeded,
    ContextOverflow,
    DraftIncompatible,
    InvalidRequest,
    MemSpecError,
    ModelLoadError,
    UnknownDraft,
)
from memspec.predictor.model import PredictorError
from memspec.server.errors import (
    HTTP_ERRORS,
    EngineError,
    NotReady,
    PayloadTooLarge,
    QueueFull,
    Unauthorized,
    UnknownModel,
    error_json,
    error_response,
)
from memspec.server.state import StateWriteError

PACKAGE = Path(memspec.__file__).parent


def _memspec_error_classes() -> list[type[MemSpecError]]:
    """Every MemSpecError subclass the package defines, found in the source so that a new one
    in a module nothing here imports is not missed."""
    classes: list[tuple[str, str, set[str]]] = []  # (module, name, base names)
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(("memspec", *path.relative_to(PACKAGE).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
                classes.append((module.removesuffix(".__init__"), node.name, bases))
    names = {"MemSpecError"}
    while grown := {n for _, n, bases in classes if names & bases} - names:
        names |= grown
    found = [getattr(importlib.import_module(m), n) for m, n, _ in classes if n in names]
    assert all(issubclass(c, MemSpecError) for c in found)
    return found


ALL_ERRORS = _memspec_error_classes()


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_class_is_mapped(cls):
    assert cls in HTTP_ERRORS, f"{cls.__name__} has no entry in server/errors.HTTP_ERRORS"
    mapped = HTTP_ERRORS[cls]
    assert 400 <= mapped.status <= 599
    assert mapped.type in ("invalid_request_error", "rate_limit_error", "server_error")


CORE = [c for c in ALL_ERRORS if not c.__module__.startswith("memspec.server")]


def test_core_errors_found():
    assert {MemSpecError, InvalidRequest, BudgetExceeded, PredictorError} <= set(CORE)


@pytest.mark.parametrize("cls", CORE, ids=lambda c: c.__name__)
def test_core_errors_know_no_http(cls):
    exc = cls("boom", param="p")
    for attr in ("status", "status_code", "http_status", "type"):
        assert not hasattr(exc, attr), f"{cls.__name__}.{attr}"
    assert exc.code is None  # the code a client sees comes from the server's table


CLIENT, SERVER = "invalid_request_error", "server_error"

# What each error answered before the mapping moved to the server: status, type, code.
BEFORE = [
    (MemSpecError("x"), 400, CLIENT, None),
    (InvalidRequest("x", param="n"), 400, CLIENT, "invalid_request"),
    (InvalidRequest("x", code="budget_too_small"), 400, CLIENT, "budget_too_small"),
    (ContextOverflow("x", param="prompt"), 400, CLIENT, "context_length_exceeded"),
    (DraftIncompatible("x", param="draft"), 400, CLIENT, "draft_incompatible"),
    (Unauthorized(), 401, CLIENT, "invalid_api_key"),
    (UnknownDraft("x", param="draft"), 404, CLIENT, "draft_not_found"),
    (UnknownModel("x", param="model"), 404, CLIENT, "model_not_found"),
    (PayloadTooLarge("x"), 413, CLIENT, "request_too_large"),
    (QueueFull("x", 3), 429, "rate_limit_error", "queue_full"),
    (ModelLoadError("x", param="model"), 500, SERVER, "model_load_failed"),
    (PredictorError("x"), 500, SERVER, "predictor_unavailable"),
    (EngineError("x"), 500, SERVER, "engine_error"),
    (NotReady("x"), 503, SERVER, "not_ready"),
    (NotReady("x", code="model_loading"), 503, SERVER, "model_loading"),
    (BudgetExceeded("x", param="draft"), 507, SERVER, "memory_budget_exceeded"),
    (StateWriteError("x"), 507, SERVER, "state_not_persisted"),
]


@pytest.mark.parametrize("exc,status,type_,code", BEFORE, ids=lambda v: repr(v)[:40])
def test_responses_unchanged(exc, status, type_, code):
    resp = error_response(exc)
    assert resp.status_code == status
    body = {"error": {"message": "x", "type": type_, "param": exc.param, "code": code}}
    if isinstance(exc, Unauthorized):
        body["error"]["message"] = exc.message
    assert json.loads(resp.body) == body == error_json(exc)
    assert resp.headers.get("WWW-Authenticate") == ("Bearer" if status == 401 else None)
    retry = getattr(exc, "retry_after_s", None)
    assert resp.headers.get("Retry-After") == (str(retry) if retry is not None else None)


def test_subclass_takes_nearest_mapped_base():
    class DraftFileGone(ModelLoadError):
        pass

    assert error_response(DraftFileGone("x")).status_code == 500
    assert error_json(DraftFileGone("x"))["error"]["code"] == "model_load_failed"
