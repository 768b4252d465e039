"""The speculative decoding loop, for one sequence or a batch of them.

Invariant: a sequence's KV cache (its slot of the target) holds every context token but the
last ("pending") one. Each round feeds [pending] + k draft tokens, which scores all k
proposals and yields one more token from the target; k = 0 is plain decoding. Rejected
candidates are dropped from the KV cache by truncation.

A round (`decode_round`) takes every active sequence through five steps:
1. choose: each picks (draft, k) by its policy (Sequence.choose); with more than one, the
   batch-level rule (costs.plan_batch) re-plans the ks for the batch as a whole (_pack_batch);
2. propose: each draft proposes up to its k (Sequence.propose);
3. verify: one forward pass of the target scores every sequence's tokens (and feeds a chunk of
   any joining sequence's prompt; the chunk that ends a prompt carries its pending token too,
   so the first token comes from that pass); the accept rule reads each sequence's rows
   (Sequence.verify; sampling.accept_rows);
4. accept: each keeps the accepted tokens, drops the rest from its KV cache, and the round is
   recorded (Sequence.accept; generation.record_round);
5. emit: each streams its new tokens, stopping on EOS, a stop string or max_tokens.
`speculative_generate` is a batch of one: the same rounds, no second engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from memspec.backends.base import Backend, argmax_rows, common_prefix
from memspec.engine.costs import BatchOption, CostModel, plan_batch
from memspec.engine.generation import ROUND_PHASES, Generation, RoundTimes, record_round
from memspec.engine.sampling import (
    SamplingParams,
    TokenHistory,
    TokenLogprob,
    accept_rows,
    token_logprob,
)
from memspec.engine.text import TextAssembler
from memspec.engine.types import Choice, Proposal, RoundPolicy
from memspec.errors import ContextOverflow, InvalidRequest

__all__ = [  # Generation, its phases and times live in engine/generation.py
    "BATCH_BACKOFF_MAX",
    "PREFILL_CHUNK",
    "ROUND_PHASES",
    "Generation",
    "RoundTimes",
    "Sequence",
    "TokenCallback",
    "accept_greedy",
    "check_prompt",
    "decode_round",
    "speculative_generate",
]

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

    def verify(self, rows: np.ndarray | None = None) -> list[int]:
        """3. The accept rule on the target's rows for [pending] + drafted: `rows` a batched
        pass returned for this sequence, or (None) a pass of its own on this slot, where
        greedy reads only each row's argmax (up to the first rejection) in the backend.
        Returns the tokens it keeps: the accepted drafted ones, then the target's."""
        t, drafted = self.times, self.drafted
        if rows is None and self._argmax_only:
            argmax0 = self.target.argmax_s
            best = self.target.eval_argmax([self.ctx[-1]] + drafted, drafted)
            t.verify_s = t.lap()
            t.argmax_s = self.target.argmax_s - argmax0  # the accept rule, in the backend
            return accept_greedy(drafted, best)
        if rows is None:
            rows = self.target.eval([self.ctx[-1]] + drafted, copy=False)
        t.verify_s = t.lap()
        if self._argmax_only:
            return accept_greedy(drafted, argmax_rows(rows, drafted))
        p, proposal = self.params, self._proposal
        q = proposal.probs if proposal is not None else None
        new = accept_rows(rows, drafted, q, p, self.rng, self.grammar, self.history)
        if p.logprobs is not None:  # token j was chosen at row j
            piece = self.target.detokenize
            self._new_logprobs = [
                token_logprob(rows[j], tok, p.logprobs, lambda i: piece([i]))
                for j, tok in enumerate(new)
            ]
        return new

    def accept(self, new: list[int], decode_s: float, batched: bool) -> None:
        """4. Keep `new`, drop the rest of the round's tokens from the KV cache, and record
        the round (generation.record_round). `decode_s`: the target's forward pass in it."""
        t = self.times
        t.sample_s = t.lap()
        self._new = new
        self.target.truncate(len(self.ctx) + len(new) - 1)
        t.truncate_s = t.lap()
        c, p, d = self._choice, self._proposal, self.drafted
        record_round(
            self.gen, self.policy, t, c, p, d, len(new) - 1, len(self.ctx), decode_s, batched
        )

    def emit(self) -> None:
        """5. Emit the kept tokens in order; stop on EOS, a stop string or max_tokens."""
        gen, record_s, t_emit = self.gen, self.times.lap(), time.perf_counter()
        detok_s = stream_s = 0.0
        for j, tok in enumerate(self._new):
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
        gen.phases["emit"] += record_s + time.perf_counter() - t_emit - detok_s - stream_s

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
    """One round of `sequences` (slots of `target`, their context's root) in one forward pass:
    choose, propose, verify, accept, emit (the module's doc). Joining sequences get a chunk of
    their prompt (`prefill_chunk` tokens at most, together), so a cancel, or a request
    joining, waits for one chunk, not the whole prompt. One sequence with no prompt to feed
    is the single-sequence round exactly. Returns (sequences, tokens) the pass carried."""
    for s in sequences:  # a client gone while its prompt is still being fed
        if s.to_prefill and not s.done and s.cancel is not None and s.cancel.is_set():
            s.gen.finish_reason, s.done = "cancelled", True
    feeding = [s for s in sequences if s.to_prefill and not s.done]
    # 1. Choose: each sequence past its prompt picks (draft, k) by its policy.
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
    # A batched pass shares its max_batch tokens out (draft depths, prompt chunks).
    depths, chunks, ending = _pack_batch(target, deciding, feeding, costs, prefill_chunk)
    # 2. Propose: each sequence's draft, up to its depth ([pending] + drafted, to verify).
    parts: list[PassPart] = []
    for s, k in depths:
        with _fails_alone(s):
            tokens = s.propose(k)
            parts.append((s, tokens, len(tokens)))
    parts += [(s, chunk, 0) for s, chunk in chunks]
    parts += [(s, chunk + s.propose(0), 1) for s, chunk in ending]  # no draft: its pending
    if not parts:  # every sequence of the round failed before its pass
        return 0, 0
    # 3. Verify: one pass over every part, in slot order (llama.cpp groups a ubatch's
    # sequences by increasing id); the batch's cost observed.
    parts.sort(key=lambda p: p[0].target.seq_id)
    decode0, t = target.decode_s, time.perf_counter()
    try:
        outs = target.eval_many([(s.target, tokens, rows) for s, tokens, rows in parts])
    except Exception as e:  # noqa: BLE001 - the pass failed: so does every request in it
        for s, _, _ in parts:
            s.fail(e)
        return 0, 0
    seconds, decode_s = time.perf_counter() - t, target.decode_s - decode0
    n_tokens = sum(len(tokens) for _, tokens, _ in parts)
    if costs is not None and len({len(tokens) for _, tokens, _ in parts}) == 1:
        costs.observe_batch(n_tokens, seconds)  # one ubatch: what batch_s calibrates
    for (s, _, rows), out in zip(parts, outs, strict=True):
        if not rows:  # a prompt chunk: nothing to accept
            s.gen.phases["prefill"] += seconds
            continue
        with _fails_alone(s):  # 3-5. its rows' accept rule, accept, emit
            s.accept(s.verify(out), decode_s, batched=True)
            s.emit()
    return len(parts), n_tokens


def _round_alone(target: Backend, s: Sequence) -> tuple[int, int]:
    """A sequence alone in the round: 2. it proposes as deep as its policy chose, 3. the
    target verifies it in a pass of its own, 4. it accepts, 5. it emits."""
    with _fails_alone(s):
        n_tokens = len(s.propose())
    if s.done:  # its draft failed
        return 0, 0
    decode0 = target.decode_s
    with _fails_alone(s):
        new = s.verify()
        s.accept(new, target.decode_s - decode0, batched=False)
        s.emit()
    return 1, n_tokens


def _prefill_alone(s: Sequence, prefill_chunk: int) -> tuple[int, int]:
    """A sequence joining with no other in the round: the target feeds it a prompt chunk."""
    t = time.perf_counter()
    chunk = s.prefill(max(prefill_chunk, 1))
    s.target.eval(chunk, all_logits=False)
    s.gen.phases["prefill"] += time.perf_counter() - t
    return 1, len(chunk)


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
            options[s] = _option(s)
    if costs is None or not options:
        return [(s, min(s._choice.k, depth)) for s in options], chunks, ending
    fed = [len(chunk) for _, chunk in chunks] + [len(chunk) + 1 for _, chunk in ending]
    ks = plan_batch(list(options.values()), costs, fed)
    for (s, o), k in zip(options.items(), ks, strict=True):
        _back_off(s, o.k if o.draft_id is not None else 0, k)
    return [(s, min(k, depth)) for s, k in zip(options, ks, strict=True)], chunks, ending


def _option(s: Sequence) -> BatchOption:
    """A sequence's choice this round as the batch-level rule sees it."""
    c, draft = s._choice, s._choice.draft
    k = min(c.k, len(c.proposal.tokens)) if c.proposal is not None else c.k
    free = draft is None or draft.free
    return BatchOption(
        draft.id if draft is not None and k > 0 else None,
        k,
        c.alpha or 0.0,
        c.alpha_cont,
        fixed=c.alpha is None,
        free=free,
        gap=draft.catchup_tokens(s.ctx) if draft is not None and not free and k > 0 else 0,
    )


def _back_off(s: Sequence, asked: int, k: int) -> None:
    """The batch-level rule gave `s` k of the `asked` drafted tokens: a refusal in a row
    doubles the rounds it goes unasked (BATCH_BACKOFF_MAX); a draft given resets it."""
    if asked > 0 and k == 0:
        s.refused += 1
        s.skip = min(2 ** (s.refused - 1), BATCH_BACKOFF_MAX)
    elif k > 0:
        s.refused = 0


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
