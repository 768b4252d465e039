"""The draft interface lives in the engine (engine/types.py), which consumes it."""

from memspec.engine.types import Draft, Proposal

__all__ = ["Draft", "Proposal"]
