"""Typed errors raised by the core. They say what went wrong, not how a protocol reports it:
`memspec/server/errors.py` maps each class to its HTTP status and OpenAI error type/code."""

from __future__ import annotations


class MemSpecError(Exception):
    """Base class. `param` names the request field at fault; `code`, when given, is a more
    precise machine-readable reason than the class's own (the server's default otherwise)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(MemSpecError):
    """The request asks for something malformed or unsupported."""


class ContextOverflow(MemSpecError):
    """Prompt plus generation does not fit in the context window."""


class UnknownDraft(MemSpecError):
    """No draft by that id in the pool."""


class UnknownModel(MemSpecError):
    """The request names a model this daemon does not serve."""


class ModelLoadError(MemSpecError):
    """A model file is missing, corrupt, not a GGUF, or could not be loaded."""


class UnusableModelFile(ModelLoadError):
    """A file in the models dir is not a GGUF this daemon can load (no GGUF magic, truncated,
    tensors past its end, a symlink out of the models dir, a directory): the request that
    names it is at fault (422), and the file stays marked bad until its size or mtime change."""


class LoadAbandoned(MemSpecError):
    """Every request that waited for a model's load went away while it loaded: the load
    stopped at its next stage rather than finish a model nobody is waiting for."""


class BudgetExceeded(MemSpecError):
    """The memory budget cannot hold what was asked for."""


class ModelDoesNotFit(BudgetExceeded):
    """A model a request names cannot be loaded within the budget now (503: the models in
    the way are pinned, or it is larger than the whole budget)."""


class DraftIncompatible(MemSpecError):
    """The draft speaks another tokenizer than the target (its token ids mean other text)."""


class DeviceUnavailable(MemSpecError):
    """A device the target is split over (a ggml RPC worker) cannot be reached, or was lost
    while it computed: the request fails, the daemon waits for the device to come back."""
