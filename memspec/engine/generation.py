"""What a generation records, and a round's bookkeeping in one place (`record_round`).

A round's phases are timed as they end (RoundTimes.lap); when it has accepted, `record_round`
adds them to the Generation, counts what was proposed and accepted per draft, and tells the
round's policy (its cost model every round a sequence decodes alone; its acceptance every
round that drafted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memspec.engine.costs import RoundCosts
from memspec.engine.sampling import TokenLogprob
from memspec.engine.types import Choice, Proposal, RoundPolicy

# prefill: the prompt tokens not in the KV cache (once per request). Then per round:
# choose: the policy (lookups peeked, rule evaluated); draft_catchup: a model draft feeding
# what it has not seen; draft_steps: its k per-token evals; verify_decode: the target's
# forward pass; verify_copy: the rest of target.eval (batch set-up, reading the logits);
# sample: the accept rule on the rows (greedy: each row's argmax, sampling: p, the draws);
# accept: KV truncation; detokenize: text and stop strings of the kept tokens; stream: the
# on_token callback (the daemon's hand-off to the client's stream); emit: the rest of the
# round's bookkeeping (cost and acceptance feedback, EOS and max_tokens checks). The phases
# are disjoint: `memspec bench runtime` adds them up into a per-token split.
ROUND_PHASES = (
    "prefill",
    "choose",
    "draft_catchup",
    "draft_steps",
    "verify_decode",
    "verify_copy",
    "sample",
    "accept",
    "detokenize",
    "stream",
    "emit",
)


@dataclass
class RoundTimes:
    """One round's phases, in seconds, each set as it ends (`lap`)."""

    start: float = field(default_factory=time.perf_counter)  # the round began (choose)
    choose_s: float = 0.0  # the policy's choice (lookups peeked, the rule evaluated)
    propose_s: float = 0.0  # the draft's proposal, any catch-up of its KV included
    verify_s: float = 0.0  # the target's pass, up to its rows being ready
    sample_s: float = 0.0  # the accept rule on the rows (an argmax in the backend: not here)
    truncate_s: float = 0.0  # dropping the rejected tokens from the KV cache
    argmax_s: float = 0.0  # the argmax inside the backend (greedy, alone): sampling's share
    _last: float = field(default=0.0, repr=False)  # when the last phase timed ended

    def lap(self) -> float:
        """Seconds since the last phase ended (or the round began)."""
        now = time.perf_counter()
        seconds, self._last = now - (self._last or self.start), now
        return seconds


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" | "length" | "cancelled"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not prefilled
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    k_per_round: list[int] = field(default_factory=list)
    # One per generated token when params.logprobs is set, from the target's verified rows.
    logprobs: list[TokenLogprob] | None = None
    drafts_used: dict[str, int] = field(default_factory=dict)  # draft id -> rounds
    per_draft: dict[str, dict[str, int]] = field(default_factory=dict)  # id -> proposed/accepted
    ttft_s: float = 0.0
    elapsed_s: float = 0.0
    draft_s: float = 0.0  # time inside draft proposals
    stall_s: float = 0.0  # time waiting on draft loads (set by the scheduler)
    # The policy it ran under ("auto", "memspec", "none"...; "": not told); on the lead slot?
    policy: str = ""
    lead: bool = True
    # The chat's context shift (context_overflow "shift"): what was dropped; None: nothing.
    context_shift: dict[str, int] | None = None
    # Where the rounds' time went (seconds): see ROUND_PHASES.
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROUND_PHASES, 0.0))

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def record_round(
    gen: Generation,
    policy: RoundPolicy,
    times: RoundTimes,
    choice: Choice,
    proposal: Proposal | None,
    drafted: list[int],
    n_accepted: int,
    context_len: int,
    decode_s: float,
    batched: bool,
) -> None:
    """A round that accepted `n_accepted` of `drafted` (`choice`'s draft, as `proposal`):
    its phases into `gen` (`decode_s`: the target's forward pass in it), the counts, and what
    `policy` learns from it. A batched pass's cost is the batch's (costs.observe_batch): only
    a round alone tells the policy its costs."""
    t = times
    catchup = proposal.catchup_s if proposal is not None else 0.0
    used = choice.draft.id if drafted and choice.draft is not None else None
    if not batched:
        gap = proposal.catchup_tokens if proposal is not None else 0
        costs = RoundCosts(used, len(drafted), t.propose_s, gap, t.verify_s, catchup, context_len)
        policy.observe_costs(costs)
    for phase, seconds in (
        ("choose", t.choose_s),
        ("draft_catchup", catchup),
        ("draft_steps", t.propose_s - catchup),
        ("verify_decode", decode_s),
        ("verify_copy", max(0.0, t.verify_s - decode_s - t.argmax_s)),
        ("sample", t.argmax_s + t.sample_s),
        ("accept", t.truncate_s),
    ):
        gen.phases[phase] += seconds
    gen.rounds += 1
    gen.k_per_round.append(len(drafted))
    if used is None or proposal is None:
        return
    gen.proposed += len(drafted)
    gen.accepted += n_accepted
    gen.drafts_used[used] = gen.drafts_used.get(used, 0) + 1
    per = gen.per_draft.setdefault(used, {"proposed": 0, "accepted": 0})
    per["proposed"] += len(drafted)
    per["accepted"] += n_accepted
    policy.observe(proposal.key, len(drafted), n_accepted, time.perf_counter() - t.start)
