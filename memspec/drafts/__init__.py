"""Drafts: anything that proposes the next tokens cheaply (model drafts, prompt lookup, ...)."""

from memspec.drafts.base import Draft, Proposal

__all__ = ["Draft", "Proposal"]
