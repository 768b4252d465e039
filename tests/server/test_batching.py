"""The daemon decodes concurrent requests in one batch (issue 12), driven with the official
openai client: every greedy answer is the one the same request gets alone; a stream that is
cut, a request that fails or is refused, leave the others exact; conversations keep their KV
per slot. No keys here (loopback)."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from launcher import MODEL, running, start

pytestmark = pytest.mark.timeout(600)

PARALLEL = 4
PROMPTS = [
    "The three primary colours are",
    "def is_prime(n):\n    ",
    "Write a short poem about autumn leaves.",
    "Extract the cities: Paris, then Rome, then Oslo, then Paris again. Cities:",
    "Explain what a hash table is in one paragraph.",
    "Count from one to ten in words: one, two,",
]
LENGTHS = [24, 40, 32, 20, 36, 28]
# A completion that goes on for hundreds of tokens on any CPU's kernels (a stream to cut).
LONG_PROMPT = "The numbers from 1 to 200, one per line:\n1\n2\n3\n4\n"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running(tmp_path_factory.mktemp("batch"), settings={"parallel": PARALLEL}) as d:
        yield d


def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def ask(daemon, i: int) -> str:
    """Request i: completions for even i, chat for odd (both paths share the batch)."""
    c = client(daemon)
    if i % 2:
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[i]}],
            max_tokens=LENGTHS[i],
            temperature=0,
        )
        return r.choices[0].message.content or ""
    r = c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=LENGTHS[i], temperature=0)
    return r.choices[0].text


def batch_histogram(daemon) -> tuple[float, float]:
    """(passes carrying one sequence, all passes) from /metrics."""
    text = httpx.get(daemon.url + "/metrics", timeout=10).text
    one = float(re.search(r'memspec_batch_sequences_bucket\{le="1\.0"\} (\S+)', text).group(1))
    total = float(re.search(r"memspec_batch_sequences_count (\S+)", text).group(1))
    return one, total


def test_concurrent_greedy_answers_are_each_one_alone(daemon):
    alone = [ask(daemon, i) for i in range(len(PROMPTS))]
    one0, total0 = batch_histogram(daemon)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda i: ask(daemon, i), range(len(PROMPTS))))
    assert together == alone
    assert sum(map(len, alone)) > 200, "empty answers prove nothing"
    one, total = batch_histogram(daemon)
    assert (total - total0) - (one - one0) > 0, "no forward pass carried two sequences"
    status = httpx.get(daemon.url + "/admin/status", timeout=10).json()
    assert status["slots"]["total"] == PARALLEL and status["slots"]["active"] == 0


def test_a_stream_cut_mid_batch_leaves_the_others_exact(daemon):
    alone = [ask(daemon, i) for i in range(3)]
    got: dict[int, str] = {}

    def run(i: int) -> None:
        got[i] = ask(daemon, i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    with httpx.stream(
        "POST",
        daemon.url + "/v1/completions",
        json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 300, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for t in threads:
            t.start()
        seen = [next(events, None) for _ in range(3)]  # a few chunks while the others run
        assert None not in seen and "[DONE]" not in seen[-1], f"stream ended before the cut: {seen}"
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(3)] == alone
    deadline = time.monotonic() + 30
    while httpx.get(daemon.url + "/admin/status", timeout=10).json()["slots"]["active"]:
        assert time.monotonic() < deadline, "the cut stream never left its slot"
        time.sleep(0.2)
    assert ask(daemon, 0) == alone[0]


def test_interleaved_conversations_reuse_their_kv(daemon):
    """Two conversations at once, then both follow-ups at once: each follow-up finds its
    prompt's prefix in a slot's KV (or the prefix cache) and reports it as cached."""
    c = client(daemon)
    topics = ["Describe a lighthouse at night in detail.", "Describe a busy bakery at dawn."]

    def turn(messages: list[dict]) -> tuple[str, int]:
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content or "", details.cached_tokens if details else 0

    firsts = [[{"role": "user", "content": t}] for t in topics]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(turn, firsts))
    follow = [
        m + [{"role": "assistant", "content": a}, {"role": "user", "content": "Go on."}]
        for m, (a, _) in zip(firsts, answers, strict=True)
    ]
    with ThreadPoolExecutor(2) as pool:
        cached = [n for _, n in pool.map(turn, follow)]
    assert all(n >= 16 for n in cached), cached


def test_failures_and_refusals_inside_a_batch_end_only_their_request(tmp_path):
    """The fault daemon with slots: a request whose engine raises before its first token, one
    that raises mid-stream, and one naming an unknown draft run among normal requests; each
    gets its own clean error, the others their exact answers, and the daemon serves on."""
    srv = start(tmp_path, "lookup", settings={"parallel": PARALLEL}, faults=True)
    try:
        srv.wait_ready()
        alone = [ask(srv, i) for i in range(3)]
        results: dict[str, object] = {}

        def normal(i: int) -> None:
            results[f"ok{i}"] = ask(srv, i)

        def failing(name: str, body: dict) -> None:
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)
            results[name] = (r.status_code, r.text)

        jobs = [threading.Thread(target=normal, args=(i,)) for i in range(3)]
        jobs += [
            threading.Thread(target=failing, args=("raise", {"prompt": "FAULT:raise x"})),
            threading.Thread(
                target=failing,
                args=("midstream", {"prompt": "FAULT:midstream one, two,", "stream": True}),
            ),
            threading.Thread(
                target=failing, args=("unknown", {"prompt": "hi", "draft": "no-such-draft"})
            ),
        ]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join(120)
        assert [results.get(f"ok{i}") for i in range(3)] == alone
        assert results["raise"][0] == 500
        status, text = results["midstream"]
        assert status == 200 and '"error"' in text  # the stream ends with an error event
        assert results["unknown"][0] == 404
        assert ask(srv, 0) == alone[0], "the daemon stopped serving after the faults"
    finally:
        srv.stop()
