"""The interfaces the engine consumes; drafts and the scheduler implement them.

The engine owns these so that it imports only backends: a draft is anything that proposes
tokens, a round policy anything that picks (draft, k) each round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from memspec.backends.base import Backend

if TYPE_CHECKING:
    from memspec.engine.costs import RoundCosts
    from memspec.engine.grammar import Grammar


@dataclass
class SamplingParams:
    """What the user asked for. The target's distribution at each position is built from
    them in memspec.engine.sampling (its module doc gives the order); every field applies at
    each verified position, so speculation never changes what is sampled."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_k: int = 0  # <= 0: off
    min_p: float = 0.0  # 0: off
    typical_p: float = 1.0  # 1: off
    repeat_penalty: float = 1.0  # 1: off (llama.cpp's)
    repeat_last_n: int = 64  # the context tokens repeat_penalty looks back on; -1: all
    presence_penalty: float = 0.0  # OpenAI's, over the generated tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logits
    logprobs: int | None = None  # alternatives reported per token (0: the token's own); None: off
    # Tokens that end the text like EOS (vLLM's stop_token_ids; a FIM prompt's end tokens).
    stop_token_ids: frozenset[int] = frozenset()
    # A grammar the output must follow (response_format, GBNF, tool calls): engine/grammar.py.
    grammar: Grammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits are changed before the distribution (bias, penalties): greedy then
        needs whole rows, not only each row's argmax."""
        return bool(self.logit_bias) or self.penalized

    @property
    def penalized(self) -> bool:
        """Whether a position's distribution depends on the tokens before it (penalties)."""
        return (
            (self.repeat_penalty != 1.0 and self.repeat_last_n != 0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    # Draft distribution q for each proposed token (sampling only); None: a deterministic
    # proposal, i.e. q is a point mass on the token (prompt lookup, greedy drafts).
    probs: list[np.ndarray] | None = None
    # Which acceptance statistic this proposal belongs to (e.g. prompt lookup per n-gram size),
    # so the acceptance estimate is conditioned on what the draft knew when it proposed.
    key: str = ""
    # The proposal's catch-up on the context (model drafts): seconds and tokens fed.
    catchup_s: float = 0.0
    catchup_tokens: int = 0
    # A lookup's match length, bucketed as its key is: how many context tokens before its copy
    # point equal the tail (0: not a copy). Until its key has been seen, α is match_prior of it.
    match: int = 0


class Draft(ABC):
    id: str
    kind: str
    # Proposes without a forward pass of its own (lookups): the rule may peek it first.
    free: bool = False

    @abstractmethod
    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Propose at most k tokens continuing `context`; fewer (or none) is allowed."""

    def catchup_tokens(self, context: list[int]) -> int:
        """Context tokens the draft must feed before it can propose after `context` (a model
        draft's KV cache is behind the target's: the whole prompt at its first use)."""
        return 0

    def token_step(self) -> Callable[[], None] | None:
        """A stand-in for one drafted token's work, for calibration to time (drafts whose
        cost is per token but which run no Backend, e.g. heads); None: not such a draft."""
        return None

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release whatever the draft holds."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"


@runtime_checkable
class ModelBacked(Protocol):
    """A draft that runs a model: calibration times its backend per token."""

    id: str
    backend: Backend


@dataclass
class Choice:
    draft: Draft | None
    k: int
    proposal: Proposal | None = None  # already made while choosing (free drafts)
    # The acceptance the rule chose by (α₁, α_c), so a batch of sequences can re-plan k
    # (costs.plan_batch); None: k was not chosen by the rule (a fixed k, a bandit's pick).
    alpha: float | None = None
    alpha_cont: float | None = None


class RoundPolicy(Protocol):
    def choose(
        self, context: list[int], k_room: int, params: SamplingParams, rng: np.random.Generator
    ) -> Choice: ...

    def observe(self, key: str, proposed: int, accepted: int, seconds: float) -> None: ...

    def observe_costs(self, measured: RoundCosts) -> None:
        """Every round, as measured; a policy with a CostModel corrects it."""
