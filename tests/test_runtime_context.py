"""The context a runtime runs (issue 39), on the real SmolLM2 target: n_ctx auto resolved
against the budget, a fixed n_ctx that cannot fit refused with the numbers, and a chat over
the context refused (400) or shifted (its oldest turns dropped, and said so)."""

from __future__ import annotations

import pytest
from launcher import require_testbed

from memspec.config import Settings
from memspec.errors import BudgetExceeded, ContextOverflow, InvalidRequest
from memspec.memory.footprint import target_footprint
from memspec.request_check import ClientRequest
from memspec.runtime import Runtime

N_CTX = 512


def test_n_ctx_auto_loads_the_longest_context_the_budget_holds():
    """auto beside prompt lookup and q2_k: the context the plan gives is the one llama.cpp
    allocates, the runtime's settings carry it, q2_k is resident beside it, and the modelled
    footprint (every slot full at that context) is within the budget."""
    require_testbed()
    budget = 900 << 20
    s = Settings.load(n_ctx="auto", budget=budget, drafts=["prompt-lookup", "q2_k"], n_threads=1)
    rt = Runtime(s, calibrate_costs=False, batched=True)
    try:
        ctx = rt.context
        assert ctx.auto and ctx.drafts == ["prompt-lookup", "q2_k"] and ctx.limited_by == "budget"
        assert 2048 <= ctx.n_ctx < ctx.trained and ctx.n_ctx % 256 == 0
        assert rt.target.n_ctx == rt.settings.n_ctx == ctx.n_ctx and rt.slots == ctx.slots == 1
        assert set(rt.drafts) == {"prompt-lookup", "q2_k"}
        assert rt.modelled_bytes() <= budget
        over = target_footprint(rt.target.path, ctx.n_ctx + 256, s.k_max).total
        assert over + ctx.drafts_bytes > budget  # one step longer would not fit
        status = rt.memory_status()["context"]
        assert status["n_ctx"] == ctx.n_ctx and status["drafts"] == ["prompt-lookup", "q2_k"]
        assert status["without_drafts"] > ctx.n_ctx  # what q2_k costs in context
    finally:
        rt.close()


def test_a_fixed_n_ctx_that_cannot_fit_is_refused_with_the_numbers():
    require_testbed()
    s = Settings.load(n_ctx=8192, budget="700MB", drafts=[], n_threads=1)
    with pytest.raises(BudgetExceeded) as e:
        Runtime(s, calibrate_costs=False)
    msg = e.value.message
    assert "at n_ctx 8192" in msg and "667.57 MiB" in msg
    assert "the longest n_ctx that fits this budget is 2048 tokens per slot" in msg


@pytest.fixture(scope="module")
def runtime():
    require_testbed()
    s = Settings.load(n_ctx=N_CTX, drafts=[], n_threads=1)
    rt = Runtime(s, calibrate_costs=False)
    yield rt
    rt.close()


def chat(turns: int) -> list[dict[str, str]]:
    """A system prompt and `turns` question/answer turns of about 80 tokens each, then a last
    question."""
    messages = [{"role": "system", "content": "You are a terse assistant. Answer in one line."}]
    for i in range(turns):
        messages += [
            {"role": "user", "content": f"Question {i}: " + "tell me about the sea. " * 12},
            {"role": "assistant", "content": f"Answer {i}: " + "the sea is wide and deep. " * 8},
        ]
    return messages + [{"role": "user", "content": "What is the capital of France?"}]


def test_a_chat_over_the_context_is_refused_by_default(runtime):
    messages = chat(5)
    assert len(runtime.requests.prompt_tokens(messages=messages)) > N_CTX
    with pytest.raises(ContextOverflow) as e:
        runtime.requests.check(ClientRequest(messages=messages, max_tokens=16))
    assert e.value.param == "messages"  # a 400 context_length_exceeded (server/errors.py)
    assert 'context_overflow: "shift"' in e.value.message
    with pytest.raises(InvalidRequest):
        runtime.requests.check(ClientRequest(messages=messages, context_overflow="truncate"))


def test_shift_keeps_the_system_prompt_and_drops_the_oldest_turns(runtime):
    """context_overflow shift: the fewest oldest turns dropped for the prompt and max_tokens
    to fit; the system prompt and the last turns kept whole; the answer decodes from exactly
    the kept conversation, and its Generation says what was dropped."""
    messages = chat(5)
    whole = len(runtime.requests.prompt_tokens(messages=messages))
    max_tokens = 8
    req = runtime.requests.check(
        ClientRequest(messages=messages, max_tokens=max_tokens, context_overflow="shift")
    )
    kept = req.messages
    shift = req.context_shift
    assert kept is not None and shift is not None
    assert kept[0] == messages[0] and kept[1]["role"] == "user"
    assert kept == [messages[0], *messages[1 + shift["dropped_messages"] :]]
    assert shift["dropped_messages"] % 2 == 0 and shift["dropped_messages"] > 0
    assert req.prompt == runtime.requests.prompt_tokens(messages=kept)
    assert shift["dropped_tokens"] == whole - len(req.prompt)
    assert len(req.prompt) + max_tokens <= N_CTX
    # One turn fewer dropped would not have fitted.
    more = [messages[0], *messages[shift["dropped_messages"] - 1 :]]
    assert len(runtime.requests.prompt_tokens(messages=more)) + max_tokens > N_CTX
    seq = runtime.open_sequence(req)
    while not seq.done:
        runtime.decode_round([seq])
    gen = runtime.close_sequence(seq)
    assert gen.context_shift == shift and gen.prompt_tokens == len(req.prompt)
    # A chat that fits is left whole, shift or not; the setting is the default.
    short = chat(1)
    req = runtime.requests.check(
        ClientRequest(messages=short, max_tokens=8, context_overflow="shift")
    )
    assert req.context_shift is None and req.messages == short
    configured = runtime.settings
    runtime.settings = configured.model_copy(update={"context_overflow": "shift"})  # a tune
    try:
        req = runtime.requests.check(ClientRequest(messages=messages, max_tokens=max_tokens))
        assert req.context_shift == shift
    finally:
        runtime.settings = configured


def test_shift_cannot_drop_the_last_turn(runtime):
    """One user turn over the context: nothing to drop, the same 400."""
    messages = [{"role": "user", "content": "the sea is wide. " * 200}]
    with pytest.raises(ContextOverflow) as e:
        runtime.requests.check(ClientRequest(messages=messages, context_overflow="shift"))
    assert "dropping its older turns would not make it fit" in e.value.message
