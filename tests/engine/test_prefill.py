"""Chunked prefill on the real SmolLM2 target: a long prompt is fed `prefill_chunk` tokens a
round, alone or beside decoding sequences, token for token what one pass gives; a cancelled
request stops between chunks (issue 39)."""

from __future__ import annotations

import threading

import pytest
from launcher import TARGET_FILE, require_testbed

from memspec.backends.base import BackendOptions, load_backend
from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.policy import FixedPolicy
from memspec.engine.speculative import Sequence, decode_round
from memspec.engine.types import SamplingParams
from memspec.paths import models_dir

N_CTX = 1024
CHUNK = 192
PROMPT_TOKENS = 800  # bounded for CI time: five rounds of prompt alone, as an 8k one has 16
PARAMS = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def target():
    require_testbed()
    options = BackendOptions(n_ctx=N_CTX, n_seq=2, n_threads=1)  # the test box is shared
    be = load_backend(models_dir() / TARGET_FILE, options)
    yield be
    be.close()


@pytest.fixture(scope="module")
def long_prompt(target) -> list[int]:
    """800 tokens of code, repeated with variations (a file to edit)."""
    text = "".join(
        f"def step_{i}(x):\n    # step {i}: scale, then shift by {i * 7 % 13}\n"
        f"    return x * {i % 5 + 2} + {i * 7 % 13}\n\n"
        for i in range(110)
    )
    ids = target.tokenize("Rename x to value in this file:\n" + text)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def run(target, seqs: list[Sequence], chunk: int) -> None:
    """Rounds until every sequence is done."""
    while not all(s.done for s in seqs):
        decode_round(target, [s for s in seqs if not s.done], None, chunk)


@pytest.fixture(scope="module")
def reference(target, long_prompt) -> list[int]:
    """Plain decoding after the whole prompt in one round (llama.cpp's n_batch passes)."""
    slot = target.slots[0]
    slot.reset()
    whole = Sequence(slot, long_prompt, PARAMS, FixedPolicy(None, 0))
    decode_round(target, [whole], None, N_CTX)
    assert not whole.to_prefill
    run(target, [whole], N_CTX)
    return whole.result().token_ids


def test_a_long_prompt_fed_in_chunks_gives_the_unchunked_output(target, long_prompt, reference):
    """Alone, 800 prompt tokens in 192-token rounds: a round per chunk, and the greedy
    output (prompt lookup drafting, as an edit's copying does) is the one-pass prefill's."""
    slot = target.slots[0]
    slot.reset()
    chunked = Sequence(slot, long_prompt, PARAMS, FixedPolicy(PromptLookupDraft(), 4))
    fed = []
    while chunked.to_prefill:
        before = len(chunked.to_prefill)
        decode_round(target, [chunked], None, CHUNK)
        fed.append(before - len(chunked.to_prefill))
    assert fed == [CHUNK] * 4 + [PROMPT_TOKENS - 1 - 4 * CHUNK]  # the last token: pending
    run(target, [chunked], CHUNK)
    assert chunked.result().token_ids == reference and len(reference) == PARAMS.max_tokens


def test_other_sequences_decode_between_the_chunks(target, long_prompt, reference):
    """Beside a decoding sequence, the long prompt takes a chunk a round and the other gets a
    token in every one of those rounds; both outputs are their solo ones."""
    short = target.tokenize("The capital of France is")
    target.slots[0].reset()
    seq = Sequence(target.slots[0], short, PARAMS, FixedPolicy(None, 0))
    run(target, [seq], N_CTX)
    solo = {"short": seq.result().token_ids, "long": reference}
    for slot in target.slots:
        slot.reset()
    decoding = Sequence(target.slots[0], short, PARAMS, FixedPolicy(None, 0))
    decode_round(target, [decoding], None, CHUNK)  # its prompt, then a token a round
    decode_round(target, [decoding], None, CHUNK)
    joining = Sequence(target.slots[1], long_prompt, PARAMS, FixedPolicy(None, 0))
    while joining.to_prefill:
        had = len(decoding.gen.token_ids)
        decode_round(target, [s for s in (decoding, joining) if not s.done], None, CHUNK)
        assert len(decoding.gen.token_ids) == had + 1 or decoding.done
    run(target, [decoding, joining], CHUNK)
    assert decoding.result().token_ids == solo["short"]
    assert joining.result().token_ids == solo["long"]


def test_a_cancel_stops_the_prefill_between_chunks(target, long_prompt):
    """A client gone after the first chunk: the next round feeds nothing more and ends the
    request as cancelled; the KV holds the one chunk fed."""
    slot = target.slots[0]
    slot.reset()
    cancel = threading.Event()
    seq = Sequence(slot, long_prompt, PARAMS, FixedPolicy(None, 0), cancel=cancel)
    decode_round(target, [seq], None, CHUNK)
    assert len(slot.tokens) == CHUNK and not seq.done
    cancel.set()
    decode_round(target, [seq], None, CHUNK)
    assert seq.done and seq.gen.finish_reason == "cancelled"
    assert len(slot.tokens) == CHUNK and not seq.gen.token_ids
