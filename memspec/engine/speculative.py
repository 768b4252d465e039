"""The speculative decoding loop.

Invariant: the target's KV cache holds every context token but the last ("pending") one.
Each round feeds [pending] + k draft tokens in one batch, which scores all k proposals and
yields one more token from the target; k = 0 is plain decoding. Rejected candidates are
dropped from the KV cache by truncation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memspec.backends.base import Backend
from memspec.engine.sampling import (
    SamplingParams,
    accept_draft_token,
    probs_from_logits,
    residual,
    sample,
)
from memspec.engine.text import TextAssembler
from memspec.engine.types import Proposal, RoundPolicy
from memspec.errors import ContextOverflow, InvalidRequest

# on_token(text_delta, token_id): once per accepted token, in order; a last call with
# token_id None flushes text held back while it could still begin a stop string.
TokenCallback = Callable[[str, int | None], None]


# prefill: the prompt tokens not in the KV cache (once per request). Then per round:
# choose: the policy (lookups peeked, rule evaluated); draft_catchup: a model draft feeding
# what it has not seen; draft_steps: its k per-token evals; verify_decode: the target's
# forward pass; verify_copy: the rest of target.eval (batch set-up, reading the logits); accept:
# the accept rule and KV truncation; emit: detokenizing, stop strings, callbacks, feedback.
ROUND_PHASES = (
    "prefill",
    "choose",
    "draft_catchup",
    "draft_steps",
    "verify_decode",
    "verify_copy",
    "accept",
    "emit",
)


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
    drafts_used: dict[str, int] = field(default_factory=dict)  # draft id -> rounds
    per_draft: dict[str, dict[str, int]] = field(default_factory=dict)  # id -> proposed/accepted
    ttft_s: float = 0.0
    elapsed_s: float = 0.0
    target_s: float = 0.0  # time inside the target's forward passes
    draft_s: float = 0.0  # time inside draft proposals
    stall_s: float = 0.0  # time waiting on draft loads (set by the scheduler)
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


def accept_greedy(drafted: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy: the draft tokens that are the target's argmax, then the target's next one.

    target_argmax[i] is the target's choice at drafted[i]'s slot; one more entry than drafted
    tokens gives the bonus token when everything is accepted.
    """
    n = 0
    while n < len(drafted) and drafted[n] == target_argmax[n]:
        n += 1
    return drafted[:n] + [target_argmax[n]]


def accept_sampled(
    drafted: list[int],
    logits: np.ndarray,
    proposal: Proposal | None,
    params: SamplingParams,
    rng: np.random.Generator,
) -> list[int]:
    """Sampling: accept with min(1, p/q), else draw from norm(max(p - q, 0)); then the bonus.

    logits[i] is the target's distribution at drafted[i]'s slot (one more row than drafted
    tokens); rows after the first rejection are never read.
    """
    new: list[int] = []
    for i, tok in enumerate(drafted):
        p = probs_from_logits(logits[i], params)
        q = proposal.probs[i] if proposal is not None and proposal.probs else None
        if not accept_draft_token(tok, p, q, rng):
            return new + [sample(residual(p, q, tok), rng)]
        new.append(tok)
    return new + [sample(probs_from_logits(logits[len(drafted)], params), rng)]


def speculative_generate(
    target: Backend,
    prompt: list[int],
    params: SamplingParams,
    policy: RoundPolicy,
    on_token: TokenCallback | None = None,
    cancel: threading.Event | None = None,
) -> Generation:
    if not prompt:
        raise InvalidRequest("prompt is empty", param="prompt")
    if len(prompt) >= target.n_ctx:
        raise ContextOverflow(
            f"prompt has {len(prompt)} tokens; the context holds {target.n_ctx}", param="prompt"
        )
    t0 = time.perf_counter()
    rng = np.random.default_rng(params.seed)
    gen = Generation(prompt_tokens=len(prompt))
    text = TextAssembler(target, params.stop)

    # Prefill everything but the last prompt token, reusing any KV prefix already there.
    gen.cached_tokens = target.reuse_prefix(prompt[:-1])
    if gen.cached_tokens < len(prompt) - 1:
        target.eval(prompt[gen.cached_tokens : -1], all_logits=False)
    gen.phases["prefill"] = time.perf_counter() - t0
    ctx = list(prompt)

    while True:
        room = min(params.max_tokens - len(gen.token_ids), target.n_ctx - len(ctx))
        if room <= 0 or (cancel is not None and cancel.is_set()):
            gen.finish_reason = "cancelled" if room > 0 else "length"
            break
        # 1. Policy picks (draft, k); the draft proposes (≤ k tokens; none is fine).
        t_draft = time.perf_counter()
        choice = policy.choose(ctx, room - 1, params, rng)
        proposal = choice.proposal
        t_propose = time.perf_counter()
        if choice.draft is not None and choice.k > 0 and proposal is None:
            proposal = choice.draft.propose(ctx, choice.k, params, rng)
        drafted = proposal.tokens[: room - 1] if proposal else []
        t_verify = time.perf_counter()
        gen.draft_s += t_verify - t_draft

        # 2+3. Target scores [pending] + drafted in one batch (len(drafted) + 1 positions);
        # accept the longest agreeing prefix, then one token from the target. Greedy reads
        # only each row's argmax; sampling reads rows up to the first rejection, in place.
        decode0 = target.decode_s
        if params.greedy:
            new = accept_greedy(drafted, target.eval_argmax([ctx[-1]] + drafted))
            t_accept = time.perf_counter()
        else:
            logits = target.eval([ctx[-1]] + drafted, copy=False)
            t_accept = time.perf_counter()
            new = accept_sampled(drafted, logits, proposal, params, rng)
        gen.target_s += t_accept - t_verify
        n_accepted = len(new) - 1
        target.truncate(len(ctx) + n_accepted)  # drop rejected candidates from the KV cache
        t_emit = time.perf_counter()
        catchup = proposal.catchup_s if proposal is not None else 0.0
        policy.observe_costs(
            choice.draft.id if drafted and choice.draft is not None else None,
            len(drafted),
            t_verify - t_propose,
            proposal.catchup_tokens if proposal is not None else 0,
            t_accept - t_verify,
        )
        decode = target.decode_s - decode0
        for phase, seconds in (
            ("choose", t_propose - t_draft),
            ("draft_catchup", catchup),
            ("draft_steps", t_verify - t_propose - catchup),
            ("verify_decode", decode),
            ("verify_copy", t_accept - t_verify - decode),
            ("accept", t_emit - t_accept),
        ):
            gen.phases[phase] += seconds

        # 4. Bookkeeping and feedback.
        gen.rounds += 1
        gen.k_per_round.append(len(drafted))
        if drafted and choice.draft is not None:
            gen.proposed += len(drafted)
            gen.accepted += n_accepted
            gen.drafts_used[choice.draft.id] = gen.drafts_used.get(choice.draft.id, 0) + 1
            per = gen.per_draft.setdefault(choice.draft.id, {"proposed": 0, "accepted": 0})
            per["proposed"] += len(drafted)
            per["accepted"] += n_accepted
            policy.observe(proposal.key, len(drafted), n_accepted, time.perf_counter() - t_draft)

        # 5. Emit in order; stop on EOS, a stop string, or max_tokens.
        done = False
        for tok in new:
            if tok in target.eos_token_ids:
                gen.finish_reason, done = "stop", True
                break
            ctx.append(tok)
            gen.token_ids.append(tok)
            if gen.ttft_s == 0.0:
                gen.ttft_s = time.perf_counter() - t0
            delta, hit_stop = text.push(tok)
            if on_token is not None:
                on_token(delta, tok)
            if hit_stop:
                gen.finish_reason, done = "stop", True
                break
            if len(gen.token_ids) >= params.max_tokens:
                done = True
                break
        gen.phases["emit"] += time.perf_counter() - t_emit
        if done:
            break

    tail = text.flush()
    if tail and on_token is not None:
        on_token(tail, None)
    gen.text = text.text
    gen.elapsed_s = time.perf_counter() - t0
    return gen
