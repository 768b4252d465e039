"""Drafts: anything that proposes the next tokens cheaply (model drafts, prompt lookup, ...)."""

from memspec.engine.types import Draft, Proposal

__all__ = ["Draft", "Proposal"]
