"""Errors raised by the core, each mapped to one OpenAI-shaped error by the server."""

from __future__ import annotations


class MemSpecError(Exception):
    """Base class. `code`/`param` feed the OpenAI error object; `status` the HTTP status."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(MemSpecError):
    code = "invalid_request"


class ContextOverflow(MemSpecError):
    code = "context_length_exceeded"


class UnknownDraft(MemSpecError):
    status = 404
    code = "draft_not_found"


class ModelLoadError(MemSpecError):
    """A model file is missing, corrupt, not a GGUF, or could not be loaded."""

    status = 500
    type = "server_error"
    code = "model_load_failed"


class BudgetExceeded(MemSpecError):
    status = 507
    type = "server_error"
    code = "memory_budget_exceeded"
