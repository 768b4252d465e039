"""The draft interface: propose up to k tokens after a context."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from memspec.engine.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    # Draft distribution q for each proposed token (sampling only); None: a deterministic
    # proposal, i.e. q is a point mass on the token (prompt lookup, greedy drafts).
    probs: list[np.ndarray] | None = None
    # Which acceptance statistic this proposal belongs to (e.g. prompt lookup per n-gram size),
    # so the acceptance estimate is conditioned on what the draft knew when it proposed.
    key: str = ""


class Draft(ABC):
    id: str
    kind: str
    # Seconds per proposed token on this device (calibrated); prompt lookup is ~0.
    cost_per_token_s: float = 0.0

    @abstractmethod
    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Propose at most k tokens continuing `context`; fewer (or none) is allowed."""

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release whatever the draft holds."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"
