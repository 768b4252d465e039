"""The speculative decoding loop, for one sequence or a batch of them.

Invariant: a sequence's KV cache (its slot of the target) holds every context token but the
last ("pending") one. Each round feeds [pending] + k draft tokens, which scores all k
proposals and yields one more token from the target; k = 0 is plain decoding. Rejected
candidates are dropped from the KV cache by truncation.

A round (`decode_round`) takes every active sequence: each chooses (draft, k) by its policy and
proposes; with more than one, the batch-level rule (costs.plan_batch) re-plans the ks for the
batch as a whole; then one forward pass of the target scores every sequence's tokens (and
feeds a chunk of any joining sequence's prompt; the chunk that ends a prompt carries its pending
token too, so the first token comes from that pass); each accepts, truncates and emits on its
own.
`speculative_generate` is a batch of one: the same rounds, no second engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from memspec.backends.base import Backend, argmax_rows, common_prefix
from memspec.engine.costs import BatchOption, CostModel, RoundCosts, plan_batch
from memspec.engine.sampling import (
    SamplingParams,
    TokenHistory,
    TokenLogprob,
    accept_draft_token,
    accept_or_resample,
    adjust_logits,
    draw,
    probs_from_logits,
    residual,
    sample,
    token_logprob,
    truncates,
)
from memspec.engine.text import TextAssembler
from memspec.engine.types import Choice, Proposal, RoundPolicy
from memspec.errors import ContextOverflow, InvalidRequest

# on_token(text_delta, token_id): once per accepted token, in order; a last call with
# token_id None flushes text held back while it could still begin a stop string.
TokenCallback = Callable[[str, int | None], None]


# A sequence's prompt is fed in chunks of at most this many tokens per round (the default of
# settings.prefill_chunk, llama.cpp's n_batch here): other sequences decode between the
# chunks, a new request joins at the next round, and a cancelled one stops there.
PREFILL_CHUNK = 512

# A sequence whose drafts the batch-level rule turned down this many rounds in a row stops
# asking its policy for up to this many rounds (doubling per refusal): peeking a datastore
# costs ~0.5 ms a sequence, paid every round by every slot, while at 8 streams the rule
# seldom drafts at all. It only changes whether a round drafts, never what is accepted.
BATCH_BACKOFF_MAX = 8

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


def accept_greedy(drafted: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy: the draft tokens that are the target's argmax, then the target's next one.
    target_argmax[i] is the target's choice at drafted[i]'s slot (one more entry: the bonus
    token when all are accepted); it may stop at the first entry that disagrees (argmax_rows)."""
    n = common_prefix(drafted, target_argmax)
    return drafted[:n] + [target_argmax[n]]


def check_prompt(prompt: list[int], n_ctx: int, param: str = "prompt", hint: str = "") -> None:
    """The prompt checks, made here only (Runtime.request makes them at the edge with a hint
    of what to do; a Sequence opened by the engine's own callers makes them bare)."""
    if not prompt:
        raise InvalidRequest("prompt is empty", param=param)
    if len(prompt) >= n_ctx:
        raise ContextOverflow(
            f"This model's maximum context length is {n_ctx} tokens; the prompt has "
            f"{len(prompt)}{hint or '.'}",
            param=param,
        )


class Sequence:
    """One generation in flight on a slot of the target: its context, its policy's rounds,
    its sampling state and its output. `decode_round` moves it on by one round."""

    def __init__(
        self,
        target: Backend,
        prompt: list[int],
        params: SamplingParams,
        policy: RoundPolicy,
        on_token: TokenCallback | None = None,
        cancel: threading.Event | None = None,
    ):
        check_prompt(prompt, target.n_ctx)
        self.target, self.params, self.policy = target, params, policy
        self.on_token, self.cancel = on_token, cancel
        self.t0 = time.perf_counter()
        self.rng = np.random.default_rng(params.seed)
        self.gen = Generation(prompt_tokens=len(prompt))
        self.text = TextAssembler(target, params.stop)
        self.ctx = list(prompt)
        # The request's grammar, walked by the tokens this sequence keeps (engine/grammar.py).
        self.grammar = params.grammar.start() if params.grammar is not None else None
        # What the penalties count (prompt tail, generated tokens), pushed as tokens emit.
        self.history = TokenHistory(params, prompt) if params.penalized else None
        self.gen.logprobs = [] if params.logprobs is not None else None
        self._new_logprobs: list[TokenLogprob] = []
        # Greedy reads only each row's argmax unless a row must be changed or reported.
        self._argmax_only = (
            params.greedy
            and self.grammar is None
            and not params.adjusts_logits
            and params.logprobs is None
        )
        self.done = False
        self.error: BaseException | None = None  # what ended it, if it failed
        # Prefill everything but the last prompt token, reusing any KV prefix already there.
        self.gen.cached_tokens = target.reuse_prefix(prompt[:-1])
        self.to_prefill = prompt[self.gen.cached_tokens : -1]
        # The round in flight.
        self._choice = Choice(None, 0)
        self._proposal: Proposal | None = None
        self.drafted: list[int] = []
        self.times = RoundTimes()  # the round in flight's phases
        self._new: list[int] = []  # what the target kept this round (accepted + its own)
        self._argmax_s = 0.0  # this round's argmax inside the backend (greedy, alone)
        # Batched rounds: drafts the batch-level rule refused in a row, rounds left unasked.
        self.refused, self.skip = 0, 0

    @property
    def room(self) -> int:
        left = self.params.max_tokens - len(self.gen.token_ids)
        return min(left, self.target.n_ctx - len(self.ctx))

    def prefill(self, n: int | None = None) -> list[int]:
        """The next `n` (all: None) prompt tokens still to feed, taken off the queue."""
        chunk = self.to_prefill if n is None else self.to_prefill[:n]
        self.to_prefill = self.to_prefill[len(chunk) :]
        return chunk

    def choose(self, in_batch: bool = False, ask: bool = True) -> bool:
        """1. The policy picks (draft, k); False when the sequence is over (cancelled, no room).
        `in_batch`: other sequences share the pass, and one the batch-level rule kept refusing
        backs off (BATCH_BACKOFF_MAX) without asking its policy. Not `ask`: k = 0 unasked
        (the round that ends a joining prompt: its pending token rides with the last chunk)."""
        room = self.room
        if room <= 0 or (self.cancel is not None and self.cancel.is_set()):
            self.gen.finish_reason = "cancelled" if room > 0 else "length"
            self.done = True
            return False
        self.times = RoundTimes()
        if not ask:
            self._choice = Choice(None, 0)
        elif in_batch and self.skip > 0:
            self.skip -= 1
            self._choice = Choice(None, 0)
        else:
            self._choice = self.policy.choose(self.ctx, room - 1, self.params, self.rng)
        self.times.choose_s = self.times.lap()
        return True

    def planned(self, asked: int, k: int) -> None:
        """The batch-level rule gave this round k of the `asked` drafted tokens."""
        if asked > 0 and k == 0:
            self.refused += 1
            self.skip = min(2 ** (self.refused - 1), BATCH_BACKOFF_MAX)
        elif k > 0:
            self.refused = 0

    def option(self) -> BatchOption:
        """This round's choice as the batch-level rule sees it."""
        c, draft = self._choice, self._choice.draft
        k = min(c.k, len(c.proposal.tokens)) if c.proposal is not None else c.k
        free = draft is None or draft.free
        return BatchOption(
            draft.id if draft is not None and k > 0 else None,
            k,
            c.alpha or 0.0,
            c.alpha_cont,
            fixed=c.alpha is None,
            free=free,
            gap=draft.catchup_tokens(self.ctx) if draft is not None and not free and k > 0 else 0,
        )

    def propose(self, k: int | None = None) -> list[int]:
        """The draft proposes (≤ k tokens; none is fine): [pending] + drafted, to verify."""
        c = self._choice
        k = c.k if k is None else k
        proposal = c.proposal
        if c.draft is not None and k > 0 and proposal is None:
            proposal = c.draft.propose(self.ctx, k, self.params, self.rng)
        self._proposal = proposal
        self.drafted = proposal.tokens[: min(k, self.room - 1)] if proposal and k > 0 else []
        self.times.propose_s = self.times.lap()
        self.gen.draft_s += self.times.choose_s + self.times.propose_s
        return [self.ctx[-1]] + self.drafted

    def verify_alone(self) -> None:
        """2. The target scores [pending] + drafted on this slot alone: greedy reads only each
        row's argmax; sampling reads rows up to the first rejection, in place."""
        tokens = [self.ctx[-1]] + self.drafted
        if not self._argmax_only:
            return self.verify_rows(self.target.eval(tokens, copy=False))
        argmax0 = self.target.argmax_s
        best = self.target.eval_argmax(tokens, self.drafted)  # rows up to a rejection
        self.times.verify_s = self.times.lap()
        # The argmax ran inside eval_argmax (on the backend's buffer): it is sampling.
        self._argmax_s = self.target.argmax_s - argmax0
        self._accept(accept_greedy(self.drafted, best))

    def verify_rows(self, logits: np.ndarray) -> None:
        """2. The same with rows a batched pass returned for this sequence."""
        self.times.verify_s = self.times.lap()
        if self._argmax_only:
            self._accept(accept_greedy(self.drafted, argmax_rows(logits, self.drafted)))
        else:
            self._accept(self._accept_rows(logits))

    def _accept_rows(self, logits: np.ndarray) -> list[int]:
        """The accept rule on full rows: sampling, or greedy under a grammar, logit_bias or
        penalties; and the logprobs of the tokens it keeps, from the same rows."""
        new = self._accept_greedy(logits) if self.params.greedy else self._accept_sampled(logits)
        n_top = self.params.logprobs
        if n_top is not None:  # token j was chosen at row j
            piece = self.target.detokenize
            self._new_logprobs = [
                token_logprob(logits[j], tok, n_top, lambda t: piece([t]))
                for j, tok in enumerate(new)
            ]
        return new

    def _row(self, logits: np.ndarray, i: int) -> np.ndarray:
        """Row i with logit_bias and penalties applied, its history being the tokens before it,
        this round's drafted ones included (as plain decoding sees them)."""
        if not self.params.adjusts_logits:
            return logits[i]
        return adjust_logits(logits[i], self.params, self.history, self.drafted[:i])

    def _accept_greedy(self, logits: np.ndarray) -> list[int]:
        """Greedy on whole rows: row i's argmax among the tokens the grammar allows after the
        accepted prefix; the grammar advances on each token kept, never on a rejected one."""
        grammar, drafted = self.grammar, self.drafted

        def choose(i: int) -> int:
            if grammar is None:
                return int(np.argmax(self._row(logits, i)))
            choice = grammar.greedy(self._row(logits, i))
            grammar.accept(choice)
            return choice

        new: list[int] = []
        for i, tok in enumerate(drafted):
            choice = choose(i)
            if choice != tok:
                return new + [choice]
            new.append(tok)
        return new + [choose(len(drafted))]

    def _accept_sampled(self, logits: np.ndarray) -> list[int]:
        """Sampling: accept with min(1, p/q), else draw from norm(max(p - q, 0)); then the bonus.
        Rows after the first rejection are never read. A grammar masks each row (in its state
        after the tokens kept so far) before p is formed, and advances on each token kept."""
        params, rng, grammar, proposal = self.params, self.rng, self.grammar, self._proposal

        def row(i: int) -> np.ndarray:
            z = self._row(logits, i)
            return z if grammar is None else grammar.mask(z)

        def keep(tok: int) -> int:
            if grammar is not None:
                grammar.accept(tok)
            return tok

        new: list[int] = []
        for i, tok in enumerate(self.drafted):
            q = proposal.probs[i] if proposal is not None and proposal.probs else None
            if q is None and not truncates(params):  # a point mass: unnormalised weights do
                accepted, resampled = accept_or_resample(tok, row(i), params, rng)
            else:
                p = probs_from_logits(row(i), params)
                accepted = accept_draft_token(tok, p, q, rng)
                resampled = tok if accepted else sample(residual(p, q, tok), rng)
            if not accepted:
                return new + [keep(resampled)]
            new.append(keep(tok))
        return new + [keep(draw(row(len(self.drafted)), params, rng))]

    def _accept(self, new: list[int]) -> None:
        """3. Keep the accepted prefix and the target's token; drop the rest from the KV."""
        self.times.sample_s = self.times.lap()
        self._new = new
        self.target.truncate(len(self.ctx) + len(new) - 1)
        self.times.truncate_s = self.times.lap()

    def finish_round(self, decode_s: float, batched: bool) -> None:
        """4. Bookkeeping and feedback; 5. emit in order, stop on EOS, a stop string or
        max_tokens. `decode_s`: the target's forward-pass time in this round."""
        t_emit = time.perf_counter()
        gen, new = self.gen, self._new
        t, c, proposal, drafted = self.times, self._choice, self._proposal, self.drafted
        n_accepted = len(new) - 1
        argmax_s, self._argmax_s = self._argmax_s, 0.0
        catchup = proposal.catchup_s if proposal is not None else 0.0
        if not batched:  # a batched pass's time is the batch's (costs.observe_batch)
            used = c.draft.id if drafted and c.draft is not None else None
            gap = proposal.catchup_tokens if proposal is not None else 0
            costs = RoundCosts(
                used, len(drafted), t.propose_s, gap, t.verify_s, catchup, len(self.ctx)
            )
            self.policy.observe_costs(costs)
        for phase, seconds in (
            ("choose", t.choose_s),
            ("draft_catchup", catchup),
            ("draft_steps", t.propose_s - catchup),
            ("verify_decode", decode_s),
            ("verify_copy", max(0.0, t.verify_s - decode_s - argmax_s)),
            ("sample", argmax_s + t.sample_s),
            ("accept", t.truncate_s),
        ):
            gen.phases[phase] += seconds
        gen.rounds += 1
        gen.k_per_round.append(len(drafted))
        if drafted and c.draft is not None and proposal is not None:
            gen.proposed += len(drafted)
            gen.accepted += n_accepted
            gen.drafts_used[c.draft.id] = gen.drafts_used.get(c.draft.id, 0) + 1
            per = gen.per_draft.setdefault(c.draft.id, {"proposed": 0, "accepted": 0})
            per["proposed"] += len(drafted)
            per["accepted"] += n_accepted
            seconds = time.perf_counter() - t.start
            self.policy.observe(proposal.key, len(drafted), n_accepted, seconds)
        detok_s = stream_s = 0.0
        for j, tok in enumerate(new):
            if (
                tok in self.target.eos_token_ids
                or tok in self.params.stop_token_ids
                or (self.grammar is not None and self.grammar.is_eog(tok))
            ):
                gen.finish_reason, self.done = "stop", True
                break
            self.ctx.append(tok)
            gen.token_ids.append(tok)
            if self.history is not None:
                self.history.push(tok)
            if gen.logprobs is not None:
                gen.logprobs.append(self._new_logprobs[j])
            if gen.ttft_s == 0.0:
                gen.ttft_s = time.perf_counter() - self.t0
            t0 = time.perf_counter()
            delta, hit_stop = self.text.push(tok)
            t1 = time.perf_counter()
            detok_s += t1 - t0
            if self.on_token is not None:
                self.on_token(delta, tok)
                stream_s += time.perf_counter() - t1
            if hit_stop:
                gen.finish_reason, self.done = "stop", True
                break
            if len(gen.token_ids) >= self.params.max_tokens:
                self.done = True
                break
        gen.phases["detokenize"] += detok_s
        gen.phases["stream"] += stream_s
        gen.phases["emit"] += time.perf_counter() - t_emit - detok_s - stream_s

    def fail(self, error: BaseException) -> None:
        """End this sequence with `error` (its request fails; the batch goes on): its
        uncommitted tokens leave the KV cache."""
        self.error, self.done = error, True
        try:
            self.target.truncate(len(self.ctx) - 1)
        except Exception:  # noqa: BLE001 - a broken slot: empty it, KV and tokens alike
            self.target.reset()

    def result(self) -> Generation:
        """The finished generation (text held back for a possible stop string flushed)."""
        tail = self.text.flush()
        if tail and self.on_token is not None:
            self.on_token(tail, None)
        self.gen.text = self.text.text
        self.gen.elapsed_s = time.perf_counter() - self.t0
        if self.grammar is not None:
            self.grammar.close()
        return self.gen


# A joining sequence's prompt chunk in a batched pass.
PromptChunk = tuple[Sequence, list[int]]
# One sequence's share of a batched pass: its tokens, and how many rows of logits it reads
# back (the last `rows` of its tokens; 0: a prompt chunk, nothing to read).
PassPart = tuple[Sequence, list[int], int]


@contextlib.contextmanager
def _fails_alone(s: Sequence) -> Iterator[None]:
    """A step of one sequence's round: what it raises (its draft, its client's callback...)
    fails that sequence's request, not the batch; speculative_generate re-raises it."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
        s.fail(e)


def decode_round(
    target: Backend,
    sequences: list[Sequence],
    costs: CostModel | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
) -> tuple[int, int]:
    """One round of `sequences` (slots of `target`, their context's root) in one forward pass.
    Joining sequences get a chunk of their prompt (`prefill_chunk` tokens at most, together),
    so a cancel, or a request joining, waits for one chunk, not the whole prompt. One sequence
    with no prompt to feed is the single-sequence round exactly. Returns (sequences, tokens)
    the target's forward pass carried."""
    for s in sequences:  # a client gone while its prompt is still being fed
        if s.to_prefill and not s.done and s.cancel is not None and s.cancel.is_set():
            s.gen.finish_reason, s.done = "cancelled", True
    feeding = [s for s in sequences if s.to_prefill and not s.done]
    # Choose: each sequence past its prompt picks (draft, k) by its policy.
    in_batch = sum(not s.done for s in sequences) > 1
    deciding: list[Sequence] = []
    for s in sequences:
        if not s.done and not s.to_prefill:
            with _fails_alone(s):
                if s.choose(in_batch):
                    deciding.append(s)
    if len(deciding) + len(feeding) <= 1:  # the target to itself: a chunk, or a whole round
        if feeding:
            return _prefill_alone(feeding[0], prefill_chunk)
        return _round_alone(target, deciding[0]) if deciding else (0, 0)
    # Pack: a batched pass shares its max_batch tokens out (draft depths, prompt chunks).
    depths, chunks, ending = _pack_batch(target, deciding, feeding, costs, prefill_chunk)
    # Propose: each sequence's draft, up to its depth ([pending] + drafted, to verify).
    parts: list[PassPart] = []
    for s, k in depths:
        with _fails_alone(s):
            tokens = s.propose(k)
            parts.append((s, tokens, len(tokens)))
    parts += [(s, chunk, 0) for s, chunk in chunks]
    parts += [(s, chunk + s.propose(0), 1) for s, chunk in ending]  # no draft: its pending
    # Verify all in one pass, then accept and emit (Sequence.verify_rows, finish_round).
    return _verify_batched(target, parts, costs)


def _prefill_alone(s: Sequence, prefill_chunk: int) -> tuple[int, int]:
    """A sequence joining with no other in the round: the target feeds it a prompt chunk."""
    t = time.perf_counter()
    chunk = s.prefill(max(prefill_chunk, 1))
    s.target.eval(chunk, all_logits=False)
    s.gen.phases["prefill"] += time.perf_counter() - t
    return 1, len(chunk)


def _round_alone(target: Backend, s: Sequence) -> tuple[int, int]:
    """A sequence alone in the round proposes as deep as its policy chose, and the target
    verifies it in a pass of its own (Sequence.verify_alone); it accepts and emits."""
    with _fails_alone(s):
        n_tokens = len(s.propose())
    if s.done:  # its draft failed
        return 0, 0
    decode0 = target.decode_s
    with _fails_alone(s):
        s.verify_alone()
        s.finish_round(target.decode_s - decode0, batched=False)
    return 1, n_tokens


def _pack_batch(
    target: Backend,
    deciding: list[Sequence],
    feeding: list[Sequence],
    costs: CostModel | None,
    prefill_chunk: int,
) -> tuple[list[tuple[Sequence, int]], list[PromptChunk], list[PromptChunk]]:
    """Share one batched pass's max_batch tokens out: (depths, chunks, ending). First every
    verification (pending + drafted, no deeper than any sequence asked; the batch-level rule
    re-plans the ks when there is a cost model), then prompt chunks in the room prefill_chunk
    and the verifications leave (sizing the depth by the batch alone left the prompts n_batch
    mod n tokens a round: a request joining three others waited seconds). `ending`: chunks
    that end a prompt with room for its pending token, whose first token comes from this
    pass (k = 0, the policy unasked), not from a round of its own after it."""
    asked = max((s._choice.k for s in deciding), default=0)
    depth = max(0, min(asked, (target.max_batch - len(deciding)) // max(len(deciding), 1)))
    room = min(max(prefill_chunk, 1), target.max_batch - len(deciding) * (depth + 1))
    chunks: list[PromptChunk] = []
    ending: list[PromptChunk] = []
    for s in feeding:
        if room <= 0:
            break
        chunk = s.prefill(room)
        room -= len(chunk)
        if not s.to_prefill and room > 0 and s.choose(in_batch=True, ask=False):
            room -= 1
            ending.append((s, chunk))
        else:
            chunks.append((s, chunk))
    options: dict[Sequence, BatchOption] = {}
    for s in deciding:
        with _fails_alone(s):
            options[s] = s.option()
    if costs is None or not options:
        return [(s, min(s._choice.k, depth)) for s in options], chunks, ending
    fed = [len(chunk) for _, chunk in chunks] + [len(chunk) + 1 for _, chunk in ending]
    ks = plan_batch(list(options.values()), costs, fed)
    for (s, o), k in zip(options.items(), ks, strict=True):
        s.planned(o.k if o.draft_id is not None else 0, k)
    return [(s, min(k, depth)) for s, k in zip(options, ks, strict=True)], chunks, ending


def _verify_batched(
    target: Backend, parts: list[PassPart], costs: CostModel | None
) -> tuple[int, int]:
    """One forward pass of the target over every part (target.eval_many), in slot order
    (llama.cpp groups a ubatch's sequences by increasing id); the batch's cost observed, and
    each sequence handed its rows to accept and emit."""
    if not parts:  # every sequence of the round failed before its pass
        return 0, 0
    parts.sort(key=lambda p: p[0].target.seq_id)
    decode0 = target.decode_s
    t = time.perf_counter()
    try:
        outs = target.eval_many([(s.target, tokens, rows) for s, tokens, rows in parts])
    except Exception as e:  # noqa: BLE001 - the pass failed: so does every request in it
        for s, _, _ in parts:
            s.fail(e)
        return 0, 0
    seconds = time.perf_counter() - t
    n_tokens = sum(len(tokens) for _, tokens, _ in parts)
    if costs is not None and len({len(tokens) for _, tokens, _ in parts}) == 1:
        costs.observe_batch(n_tokens, seconds)  # one ubatch: what batch_s calibrates
    decode_s = target.decode_s - decode0
    for (s, _, rows), out in zip(parts, outs, strict=True):
        if not rows:
            s.gen.phases["prefill"] += seconds
            continue
        with _fails_alone(s):
            s.verify_rows(out)
            s.finish_round(decode_s, batched=True)
    return len(parts), n_tokens


def speculative_generate(
    target: Backend,
    prompt: list[int],
    params: SamplingParams,
    policy: RoundPolicy,
    on_token: TokenCallback | None = None,
    cancel: threading.Event | None = None,
) -> Generation:
    """Generate one sequence on `target` (a batch of one)."""
    seq = Sequence(target, prompt, params, policy, on_token, cancel)
    while not seq.done:
        decode_round(target.kv_owner, [seq])
    if seq.error is not None:
        raise seq.error
    return seq.result()
