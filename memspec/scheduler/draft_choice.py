"""A request's `draft` field, decoded in one place: "none", "auto" or one draft's id.

The API and the CLI carry the field as the client wrote it (a string); DraftAdmin.draft_ask
parses it once into the DraftAsk that GenerationRequest and the Scheduler carry, so the words
"none" and "auto" are compared here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"  # the scheduler decides (by the request's policy)
NONE = "none"  # plain target decoding, no draft


@dataclass(frozen=True)
class DraftAsk:
    """What a request asked of the drafts: `plain` ("none": no draft), `auto` (the scheduler
    decides), or `named`, the one draft id it asked for (None unless it named one)."""

    plain: bool = False
    named: str | None = None

    @classmethod
    def parse(cls, raw: str) -> DraftAsk:
        """The meaning of a `draft` field as sent. A named draft is not checked here
        (DraftAdmin.draft_ask: unknown is a 404, incompatible a 400)."""
        if raw == NONE:
            return cls(plain=True)
        if raw == AUTO:
            return cls()
        return cls(named=raw)

    @property
    def auto(self) -> bool:
        return not self.plain and self.named is None

    @property
    def ids(self) -> list[str] | None:
        """The drafts a round may use: the named one, or None for any (auto; plain uses
        none, so asking is a mistake)."""
        assert not self.plain, "a plain request uses no draft"
        return None if self.named is None else [self.named]

    def __str__(self) -> str:
        """The field as a client would send it."""
        return NONE if self.plain else AUTO if self.named is None else self.named


AUTO_ASK = DraftAsk()  # the default: the scheduler decides
