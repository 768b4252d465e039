"""The OpenAI endpoints through the official `openai` client, against the real daemon."""

from __future__ import annotations

import openai
import pytest
from launcher import MODEL, N_CTX, TARGET_FILE

from memspec.engine.sampling import SamplingParams

MAX_TOKENS = 12
QUESTION = "Name three primary colors."


@pytest.fixture(scope="module")
def reference(reference_runtime) -> dict[str, str]:
    """Plain greedy target decoding in this process: chat and completion prompts."""
    rt = reference_runtime
    chat = rt.requests.prompt_tokens(messages=[{"role": "user", "content": QUESTION}])
    text = rt.requests.prompt_tokens(prompt="The three primary colors are")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return {
        "chat": rt.generate(chat, params, draft="none").text,
        "completion": rt.generate(text, params, draft="none").text,
    }


def test_models(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == MODEL and len(set(ids)) == len(ids)  # the default first, then the dir's
    assert client.models.retrieve(MODEL).id == MODEL


def test_one_model_id_everywhere(client, http, admin_http):
    """Ollama's library name for the target: listed, in /health and status, and in every
    answer, also to a request that names the target by its file or by the id of its
    general.name (what wave 3 served)."""
    assert MODEL == "smollm2:135m"
    assert http.get("/health").json()["model"] == MODEL
    status = admin_http.get("/admin/status").json()
    assert status["model"] == MODEL
    assert status["chat_template"] == {"source": "gguf", "warning": None}
    assert client.models.retrieve(TARGET_FILE).id == MODEL
    for asked in (MODEL, TARGET_FILE, "smollm2-135m-8k-lc100k-mix1-ep2"):
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
        # Where its time went: the target's passes are most of it, and no phase outlasts
        # the generation.
        phases = ms["phases_ms"]
        assert phases["verify_decode"] > 0  # (prefill: 0 where the prompt was cached)
        assert sum(phases.values()) <= ms["elapsed_ms"]
        assert ms["elapsed_ms"] >= ms["ttft_s"] * 1e3


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


# --- every sampling field, logprobs, the context, llama-server's routes (issue 28) ----------

PROCESSED = {
    "top_k": 20,
    "min_p": 0.01,
    "repeat_penalty": 1.3,
    "repeat_last_n": 32,
    "presence_penalty": 0.6,
    "frequency_penalty": 0.4,
    "logit_bias": {"28": -3.0},
}


def test_sampling_fields_greedy_equal_plain_decoding(client, reference_runtime):
    """Greedy with the fields equals plain decoding with them in this process, whatever the
    draft; llama-server's n_predict and repetition_penalty names map onto ours."""
    rt = reference_runtime
    prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": QUESTION}])
    fields = {k: v for k, v in PROCESSED.items() if k != "logit_bias"}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias={28: -3.0}, **fields)
    expected = rt.generate(prompt, params, draft="none").text
    assert expected != rt.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), "none").text
    for draft in ("auto", "none", "q4_0"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"draft": draft, **PROCESSED},
        )
        assert r.choices[0].message.content == expected, draft
    aliased = dict(PROCESSED, repetition_penalty=PROCESSED["repeat_penalty"], n_predict=MAX_TOKENS)
    del aliased["repeat_penalty"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        extra_body=aliased,
    )
    assert r.choices[0].message.content == expected


def test_top_k_1_is_greedy_whatever_the_seed(client, reference):
    """The issue's report: top_k 1 at temperature 1.5 gave a different answer per seed."""
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS,
            temperature=1.5,
            seed=seed,
            extra_body={"top_k": 1},
        )
        assert r.choices[0].message.content == reference["chat"], seed


def test_logprobs_with_a_draft_equal_plain_decoding(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    plain = client.chat.completions.create(**kwargs, extra_body={"draft": "none"})
    # fixed:q4_0 drafts every round (k >= 1): logprobs come from batched verification rows.
    drafted = client.chat.completions.create(**kwargs, extra_body={"policy": "fixed:q4_0"})
    assert drafted.model_extra["memspec"]["proposed"] > 0
    a, b = plain.choices[0].logprobs.content, drafted.choices[0].logprobs.content
    assert len(a) == plain.usage.completion_tokens and len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        assert len(x.top_logprobs) == 3 and x.logprob <= 0
    assert "".join(t.token for t in a) == plain.choices[0].message.content
    # Streamed: the same entries, spread over the chunks.
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in a
    ]


def test_completion_logprobs(client, reference):
    kwargs = dict(
        model=MODEL,
        prompt="The three primary colors are",
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=2,
    )
    r = client.completions.create(**kwargs)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == reference["completion"]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_max_tokens_beyond_the_context_is_capped(client, http):
    """A prompt that leaves 6 tokens of context and max_tokens 4096: 6 tokens, `length`."""
    ids = http.post("/tokenize", json={"content": "the sea " * 600}).json()["tokens"]
    prompt = ids[: N_CTX - 6]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4096, temperature=0, extra_body={"draft": "none"}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6


def test_tokenize_and_detokenize(http, reference_runtime):
    text = "Hello <|im_start|> world"
    r = http.post("/tokenize", json={"content": text}).json()
    assert r["tokens"] == reference_runtime.target.tokenize(text, add_bos=False, special=True)
    plain = http.post("/tokenize", json={"content": text, "parse_special": False}).json()
    assert len(plain["tokens"]) > len(r["tokens"])
    pieces = http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"
    ids = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}
    bad = http.post("/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_unknown_fields_are_named_not_silent(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    r = client.chat.completions.create(**ask, temperature=0, extra_body={"cache_prompt": True})
    assert r.choices[0].finish_reason  # cache_prompt: known, and cannot change the output
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask, extra_body={"my_sampler_knob": 3})
    assert e.value.status_code == 400 and e.value.body["param"] == "my_sampler_knob"


def test_n_choices(client):
    """n choices: choice i is the generation seeded seed + i would give alone."""
    kwargs = dict(
        model=MODEL,
        prompt="The three primary colors are",
        max_tokens=6,
        temperature=1.0,
        extra_body={"draft": "none"},
    )
    r = client.completions.create(n=2, seed=7, **kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    alone = [client.completions.create(seed=s, **kwargs) for s in (7, 8)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
