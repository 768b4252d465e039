"""Context shift for chats that outgrow the context (settings.context_overflow = "shift").

llama-server's context shift drops the oldest tokens after the kept prefix when the context is
full. A chat does it here before anything runs, on whole messages: the system prompt (the
leading system messages) is kept, and the oldest turns after it are dropped, each turn from a
user message up to the next one (the assistant's answer and tool results go with it), until
the prompt and max_tokens fit. A template never sees a conversation that opens with an
assistant. What was dropped is reported in the response's `memspec` object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class Shifted:
    prompt: list[int]  # the kept messages, rendered and tokenized
    messages: list[dict[str, Any]]  # the system prompt and the turns kept
    dropped_messages: int
    dropped_tokens: int  # the original prompt's tokens less the kept one's

    def report(self) -> dict[str, int]:
        """What the response's `memspec.context_shift` says."""
        return {"dropped_messages": self.dropped_messages, "dropped_tokens": self.dropped_tokens}


def shift_messages(
    messages: list[dict[str, Any]],
    prompt_len: int,
    render: Callable[[list[dict[str, Any]]], list[int]],
    n_ctx: int,
    max_tokens: int,
) -> Shifted | None:
    """The fewest oldest turns to drop so that the prompt and `max_tokens` fit `n_ctx`; where
    even the last turn leaves less than max_tokens, the fewest so that the prompt fits (the
    answer is then capped at the context's end, as without a shift). `prompt_len`: the whole
    conversation's tokens; `render`: messages to prompt tokens. None: no turn can be dropped
    (one user turn), or even the last turn alone does not fit."""
    system = 0
    while system < len(messages) and messages[system].get("role") in SYSTEM_ROLES:
        system += 1
    # Where a kept conversation may start: each user message after the first turn.
    starts = [i for i in range(system + 1, len(messages)) if messages[i].get("role") == "user"]
    if not starts:
        return None

    @functools.cache
    def kept(start: int) -> list[int]:
        return render(messages[:system] + messages[start:])

    def fewest(fits: Callable[[int], bool]) -> int | None:
        """The first start whose prompt fits (prompts shrink as turns go: bisect)."""
        if not fits(len(kept(starts[-1]))):
            return None
        lo, hi = 0, len(starts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(len(kept(starts[mid]))) else (mid + 1, hi)
        return starts[lo]

    start = fewest(lambda n: n + max_tokens <= n_ctx)
    if start is None:
        start = fewest(lambda n: n < n_ctx)
    if start is None:
        return None
    prompt = kept(start)
    return Shifted(
        prompt=prompt,
        messages=messages[:system] + messages[start:],
        dropped_messages=start - system,
        dropped_tokens=prompt_len - len(prompt),
    )
