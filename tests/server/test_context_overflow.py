"""A chat over the daemon's context (issue 39): a 400 context_length_exceeded by default, or,
with context_overflow "shift", an answer from the conversation's last turns with what was
dropped in the response's `memspec` object."""

from __future__ import annotations

from launcher import MODEL, N_CTX


def long_chat(turns: int = 8) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    for i in range(turns):
        messages += [
            {"role": "user", "content": f"Question {i}: " + "tell me about the sea. " * 12},
            {"role": "assistant", "content": f"Answer {i}: " + "the sea is wide and deep. " * 8},
        ]
    return messages + [{"role": "user", "content": "What is the capital of France?"}]


def test_a_chat_over_the_context_is_a_400_or_shifted(http):
    body = {"model": MODEL, "messages": long_chat(), "max_tokens": 4, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    r = http.post("/v1/chat/completions", json={**body, "context_overflow": "shift"})
    assert r.status_code == 200, r.text
    out = r.json()
    shift = out["memspec"]["context_shift"]
    assert shift["dropped_messages"] > 0 and shift["dropped_messages"] % 2 == 0
    assert shift["dropped_tokens"] > 0
    assert out["usage"]["prompt_tokens"] + 4 <= N_CTX
    # A chat that fits says nothing of a shift.
    short = {**body, "messages": long_chat(0), "context_overflow": "shift"}
    r = http.post("/v1/chat/completions", json=short)
    assert r.status_code == 200 and r.json()["memspec"]["context_shift"] is None
    bad = http.post("/v1/chat/completions", json={**body, "context_overflow": "truncate"})
    assert bad.status_code == 400
