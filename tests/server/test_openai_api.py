"""The OpenAI endpoints through the official `openai` client, against the real daemon."""

from __future__ import annotations

import pytest
from launcher import MODEL, TARGET_FILE

from memspec.engine.sampling import SamplingParams

MAX_TOKENS = 12
QUESTION = "Name three primary colors."


@pytest.fixture(scope="module")
def reference(reference_runtime) -> dict[str, str]:
    """Plain greedy target decoding in this process: chat and completion prompts."""
    rt = reference_runtime
    chat = rt.prompt_tokens(messages=[{"role": "user", "content": QUESTION}])
    text = rt.prompt_tokens(prompt="The three primary colors are")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return {
        "chat": rt.generate(chat, params, draft="none").text,
        "completion": rt.generate(text, params, draft="none").text,
    }


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_one_model_id_everywhere(client, http, admin_http):
    """The id made from the target's general.name: listed, in /health and status, and in every
    answer, also to a request that names the target by its file."""
    assert MODEL == "smollm2-135m-8k-lc100k-mix1-ep2"  # general.name "Smollm2 135M 8k Lc100K ..."
    assert http.get("/health").json()["model"] == MODEL
    status = admin_http.get("/admin/status").json()
    assert status["model"] == MODEL
    assert status["chat_template"] == {"source": "gguf", "warning": None}
    assert client.models.retrieve(TARGET_FILE).id == MODEL
    for asked in (MODEL, TARGET_FILE):
        r = client.completions.create(model=asked, prompt="Hi", max_tokens=1, temperature=0)
        assert r.model == MODEL, asked
        chat = client.chat.completions.create(
            model=asked, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0
        )
        assert chat.model == MODEL, asked


def test_chat_greedy_matches_plain_decoding(client, reference):
    for draft in ("auto", "none"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"draft": draft},
        )
        assert r.choices[0].message.content == reference["chat"], draft
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens <= MAX_TOKENS
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        ms = r.model_extra["memspec"]
        assert set(ms) >= {"drafts_used", "proposed", "accepted", "acceptance", "k", "stall_s"}
        assert ms["rounds"] >= 1
        if draft == "none":
            assert ms["proposed"] == 0 and ms["drafts_used"] == {}


def test_per_request_policy(client, reference):
    for policy in ("ucb", "memspec", "fixed:prompt-lookup"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"policy": policy},
        )
        assert r.choices[0].message.content == reference["chat"], policy


def test_completion_greedy_matches_plain_decoding(client, reference):
    r = client.completions.create(
        model=MODEL, prompt="The three primary colors are", max_tokens=MAX_TOKENS, temperature=0
    )
    assert r.choices[0].text == reference["completion"]
    assert r.usage.completion_tokens >= 1


def test_chat_stream_equals_non_stream(client, reference):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
    )
    plain = client.chat.completions.create(**kwargs).usage
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"]
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("length", "stop") and all(f is None for f in finals[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == plain.completion_tokens
    assert usage.prompt_tokens == plain.prompt_tokens
    # The same prompt was just decoded: the stream reuses its KV and reports it.
    cached = usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens - 1 <= cached < usage.prompt_tokens, (cached, usage)


def test_completion_stream(client, reference):
    stream = client.completions.create(
        model=MODEL,
        prompt="The three primary colors are",
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == reference["completion"]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stop_strings(client, reference):
    full = reference["completion"]
    cut = next((i for i in range(3, len(full)) if full[i].isalpha()), None)
    assert cut is not None, f"reference too short to cut: {full!r}"
    stop = full[cut : cut + 2]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        kwargs = dict(
            model=MODEL,
            prompt="The three primary colors are",
            max_tokens=MAX_TOKENS,
            temperature=0,
            stop=[stop, "\n\n\n"],
        )
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kwargs)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == expected, (stream, stop)
        assert reason == "stop"
    r = client.completions.create(
        model=MODEL,
        prompt="The three primary colors are",
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=stop,  # a plain string works too
    )
    assert r.choices[0].text == expected


def test_second_turn_reuses_kv(client):
    first = [{"role": "user", "content": "Write one sentence about the sea."}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=16, temperature=0)
    turn2 = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Now one about mountains."},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - 1, (cached, r1.usage.prompt_tokens)
    assert cached < r2.usage.prompt_tokens


def test_interleaved_sessions_reuse_through_prefix_cache(client, admin_http):
    """A's follow-up after B ran still reuses A's KV (restored from the prefix cache)."""
    a = [{"role": "user", "content": "List four animals that live in the ocean, briefly."}]
    b = [{"role": "user", "content": "What is a good name for a small grey cat?"}]
    ra = client.chat.completions.create(model=MODEL, messages=a, max_tokens=24, temperature=0)
    client.chat.completions.create(model=MODEL, messages=b, max_tokens=24, temperature=0)
    a2 = a + [
        {"role": "assistant", "content": ra.choices[0].message.content},
        {"role": "user", "content": "Which is largest?"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=a2, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= ra.usage.prompt_tokens - 1
    cache = admin_http.get("/admin/status").json()["prefix_cache"]
    assert cache["restores"] >= 1 and cache["bytes"] > 0


def test_seeded_sampling_is_reproducible(client):
    # Plain decoding: a speculative sample's value depends on which draft proposed it and the
    # adaptive policy's choices depend on what it has learned since (its distribution never
    # does), so only the same decode schedule repeats a seeded sample (docs/daemon.md).
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a word."}],
        max_tokens=8,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        extra_body={"draft": "none"},
    )
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_named_draft(client, reference):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"draft": "prompt-lookup"},
    )
    assert r.choices[0].message.content == reference["chat"]
    assert set(r.model_extra["memspec"]["drafts_used"]) <= {"prompt-lookup"}
