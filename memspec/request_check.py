"""A client's request, checked once against one target into what the engine decodes.

ClientRequest is a generation as a client asks for it (the API routes build it). RequestCheck
makes it a GenerationRequest the runtime runs as it is: its prompt tokens (a chat rendered by
the target's template, shifted to fit the context when asked; a fill-in-the-middle prompt),
its sampling parameters with every token id checked against the vocabulary, and the draft and
policy it names. What it refuses is the error the client gets (a 4xx), raised before anything
runs. Built and held by the Runtime (memspec.runtime: `Runtime.requests`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jinja2

from memspec.backends.base import Backend
from memspec.config import Settings
from memspec.draft_admin import DraftAdmin
from memspec.engine.context_shift import Shifted, shift_messages
from memspec.engine.fim import FimRequest, FimTokens, fim_prompt, find_fim_tokens
from memspec.engine.grammar import Grammar
from memspec.engine.speculative import check_prompt
from memspec.engine.types import SamplingParams
from memspec.errors import InvalidRequest
from memspec.scheduler.draft_choice import AUTO_ASK, DraftAsk

log = logging.getLogger(__name__)


@dataclass
class ClientRequest:
    """A generation as a client asks for it, before it is checked against the runtime."""

    prompt: str | list[int] | None = None  # text, or token ids (completions)
    messages: list[dict[str, str]] | None = None  # chat
    max_tokens: int | None = None  # None: settings.default_max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    draft: str = "auto"  # "auto", "none" or a draft id
    policy: str | None = None  # for draft "auto"; None: settings.policy
    cache_partition: str = ""  # whose cached prefixes it may reuse (key and cache_salt)
    # Sampling fields beyond temperature/top_p (None: SamplingParams' default, i.e. off).
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False  # llama-server's: end-of-generation tokens banned
    logprobs: int | None = None  # report logprobs with this many alternatives; None: off
    fim: FimRequest | None = None  # fill-in-the-middle: the prompt is built from it
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: end the text like EOS
    grammar: str | None = None  # GBNF the output must follow (engine/grammar.py)
    grammar_param: str = "grammar"  # the request field the grammar came from (its 400s)
    tools: list[dict[str, Any]] | None = None  # chat: the tools the chat template receives
    context_overflow: str | None = None  # chat: "error" or "shift"; None: the setting's
    model: str = ""  # the served name of the model that runs it ("": the default target)
    # How long the model stays loaded after this request (Ollama's keep_alive), in seconds;
    # None: settings.keep_alive; negative: no expiry; 0: unloaded once it is idle.
    keep_alive_s: float | None = None


# ClientRequest's sampling fields that map one to one onto SamplingParams.
SAMPLING_FIELDS = (
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class GenerationRequest:
    """A generation a runtime can run as it is (RequestCheck.check makes it)."""

    prompt: list[int]
    params: SamplingParams
    draft: DraftAsk = AUTO_ASK  # parsed and checked once (DraftAdmin.draft_ask)
    policy: str | None = None  # None: settings.policy
    messages: list[dict[str, str]] | None = None  # chat: what the scheduler's predictor reads
    cache_partition: str = ""  # whose cached prefixes it may reuse (PrefixCache)
    # A chat shifted to fit the context: {"dropped_messages": n, "dropped_tokens": m}.
    context_shift: dict[str, int] | None = None


class RequestCheck:
    def __init__(
        self,
        target: Backend,
        settings: Callable[[], Settings],
        drafts: DraftAdmin,
        check_policy: Callable[[str], None],
    ):
        """`settings`: the runtime's now (a live tune may replace them); `drafts`: what a
        request may name; `check_policy`: raises for a policy name the scheduler lacks."""
        self.target, self._settings = target, settings
        self._drafts, self._check_policy = drafts, check_policy

    def prompt_tokens(
        self,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if messages is not None:
            try:
                text = self.target.chat_prompt(messages, tools)
            except jinja2.TemplateError as e:  # the model's template refuses these messages
                raise InvalidRequest(
                    f"the model's chat template cannot render these messages: {e}",
                    param="messages",
                ) from None
            return self.target.tokenize(text, add_bos=True, special=True)
        return self.target.tokenize(prompt or "", add_bos=True)

    def check(self, ask: ClientRequest) -> GenerationRequest:
        """Check a client's request against the target, once: its tokens, the context, the
        draft and the policy it names. Raises the error the client gets."""
        messages, shift = ask.messages, None
        if ask.fim is not None:
            prompt = fim_prompt(self.target, ask.fim, self.fim_tokens)
        elif ask.messages is not None:
            prompt = self.prompt_tokens(messages=ask.messages, tools=ask.tools)
            messages, shift = self._shift_context(ask, prompt)
            prompt = shift.prompt if shift is not None else prompt
        elif isinstance(ask.prompt, list):
            self._check_token_ids(ask.prompt, "prompt")
            prompt = list(ask.prompt)
        else:
            prompt = self.prompt_tokens(prompt=ask.prompt or "")
        n_ctx = self.target.n_ctx
        hint = self._overflow_hint(ask) if len(prompt) >= n_ctx else ""
        param = "messages" if ask.messages is not None and prompt else "prompt"
        check_prompt(prompt, n_ctx, param, hint)
        draft = self._drafts.draft_ask(ask.draft)
        if ask.policy is not None:
            fixed = ask.policy.removeprefix("fixed:")
            if ask.policy.startswith("fixed:") and fixed in self._drafts.incompatible:
                self._drafts.usable(fixed)  # the same 400 as the draft named
            self._check_policy(ask.policy)
        # A max_tokens beyond what the context holds is capped there (finish_reason length),
        # as llama-server does; only a prompt that does not fit is refused.
        max_tokens = ask.max_tokens or self._settings().default_max_tokens
        params = SamplingParams(
            max_tokens=min(max_tokens, n_ctx - len(prompt)),
            temperature=ask.temperature,
            top_p=ask.top_p,
            seed=None if ask.seed is None else ask.seed % 2**64,
            stop=ask.stop,
            logit_bias=self._logit_bias(ask),
            logprobs=ask.logprobs,
            stop_token_ids=self._stop_tokens(ask),
            **{
                name: getattr(ask, name)
                for name in SAMPLING_FIELDS
                if getattr(ask, name) is not None
            },
        )
        if ask.grammar is not None:  # parsed against the target's vocabulary: a bad one is a 400
            params.grammar = Grammar(ask.grammar, self.target.path, param=ask.grammar_param)
        report = shift.report() if shift is not None else None
        return GenerationRequest(
            prompt, params, draft, ask.policy, messages, ask.cache_partition, report
        )

    def _overflow_hint(self, ask: ClientRequest) -> str:
        """What a client whose prompt does not fit can do about it."""
        if self._shifts(ask):
            return ", and dropping its older turns would not make it fit. Shorten it."
        if ask.messages is not None:
            return '. Shorten the conversation, or send context_overflow: "shift".'
        return ". Shorten the prompt."

    def _shifts(self, ask: ClientRequest) -> bool:
        """A chat whose overflow shifts the context (the request's choice, else the setting)."""
        overflow = ask.context_overflow or self._settings().context_overflow
        if overflow not in ("error", "shift"):
            raise InvalidRequest(
                f'context_overflow must be "error" or "shift", not {overflow!r}',
                param="context_overflow",
            )
        return ask.messages is not None and overflow == "shift"

    def _shift_context(
        self, ask: ClientRequest, prompt: list[int]
    ) -> tuple[list[dict[str, str]] | None, Shifted | None]:
        """context_overflow "shift": a chat whose prompt and max_tokens exceed the context
        keeps its system prompt and drops its oldest turns (memspec.engine.context_shift).
        Returns the messages kept and the shift (None: none needed, or none possible)."""
        max_tokens = ask.max_tokens or self._settings().default_max_tokens
        n_ctx = self.target.n_ctx
        if not self._shifts(ask) or ask.messages is None or len(prompt) + max_tokens <= n_ctx:
            return ask.messages, None

        def render(messages: list[dict[str, Any]]) -> list[int]:
            return self.prompt_tokens(messages=messages, tools=ask.tools)

        shift = shift_messages(ask.messages, len(prompt), render, n_ctx, max_tokens)
        if shift is None:
            return ask.messages, None
        log.info(
            "context shift: %d messages (%d tokens) dropped to fit n_ctx %d",
            shift.dropped_messages, shift.dropped_tokens, n_ctx,
        )  # fmt: skip
        return shift.messages, shift

    def _logit_bias(self, ask: ClientRequest) -> dict[int, float]:
        """logit_bias, checked, with ignore_eos's ban on the end-of-generation tokens."""
        self._check_token_ids(ask.logit_bias, "logit_bias")
        bias = dict(ask.logit_bias)
        if ask.ignore_eos:
            bias.update(dict.fromkeys(self.target.eos_token_ids, -math.inf))
        return bias

    def _check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """InvalidRequest naming `param` if an id is outside the target's vocabulary."""
        n_vocab = self.target.n_vocab
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"{param}: token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                param=param,
            )

    def _stop_tokens(self, ask: ClientRequest) -> frozenset[int]:
        """stop_token_ids, checked; a FIM prompt's middle also ends at the FIM end tokens."""
        self._check_token_ids(ask.stop_token_ids, "stop_token_ids")
        fim_end = self.fim_tokens.end if ask.fim is not None and self.fim_tokens else frozenset()
        return frozenset(ask.stop_token_ids) | fim_end

    @functools.cached_property
    def fim_tokens(self) -> FimTokens | None:
        """The target's fill-in-the-middle tokens (None: it has none)."""
        return find_fim_tokens(self.target)
