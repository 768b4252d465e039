"""The torch/transformers backend on the real SmolLM2 GGUF: lossless speculative decoding,
KV rollback by DynamicCache cropping, and parity with the llama.cpp backend on the same file.

transformers decodes this model eagerly at ~10-16 tok/s on a 2-core CPU, so generations are
short (24 tokens, 2 prompts). The torch models run on one thread: on a shared 2-core box
torch's two-thread pool spin-waits against other processes and slows down >10x.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.drafts.model import ModelDraft
from memspec.drafts.prompt_lookup import PromptLookupDraft
from memspec.engine.policy import FixedPolicy
from memspec.engine.sampling import SamplingParams
from memspec.engine.speculative import Generation, speculative_generate
from memspec.engine.types import Draft, Proposal
from memspec.errors import ModelLoadError
from memspec.paths import models_dir

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.torch, pytest.mark.models]

TARGET_FILE = "smollm2-135m-f32.gguf"
MAX_TOKENS = 24
OPTIONS = BackendOptions(n_ctx=512, n_threads=1)
PROMPTS = [
    # extraction: the answer quotes the prompt, so prompt lookup proposes and is accepted
    "Extract the names from this sentence: Alice met Bob and Carol at the station, "
    "then Alice and Carol took the train.",
    "What are three benefits of regular exercise?",
]


def model_path(name: str):
    path = models_dir() / name
    if not path.is_file():
        pytest.fail(f"testbed missing in {models_dir()}: run scripts/setup.sh", pytrace=False)
    return path


@pytest.fixture(scope="module")
def target():
    be = load_backend(model_path(TARGET_FILE), OPTIONS, kind="torch")
    yield be
    be.close()


@pytest.fixture(scope="module")
def torch_draft():
    be = load_backend(model_path("smollm2-135m-q4_0.gguf"), OPTIONS, kind="torch")
    yield ModelDraft("torch-q4_0", be)
    be.close()


@pytest.fixture(scope="module")
def llama_target():
    be = load_backend(model_path(TARGET_FILE), OPTIONS, kind="llama_cpp")
    yield be
    be.close()


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return [
        target.tokenize(target.chat_prompt([{"role": "user", "content": p}]), special=True)
        for p in PROMPTS
    ]


def generate(
    backend: Backend,
    prompt: list[int],
    draft: Draft | None = None,
    k: int = 0,
    params: SamplingParams | None = None,
) -> Generation:
    params = params or SamplingParams(max_tokens=MAX_TOKENS)
    return speculative_generate(backend, prompt, params, FixedPolicy(draft, k))


@pytest.fixture(scope="module")
def references(target, prompts) -> list[list[int]]:
    """Plain torch decoding, one token per forward (k = 0): the ground truth."""
    refs = [generate(target, p).token_ids for p in prompts]
    assert all(len(r) >= 8 for r in refs), refs  # long enough to span several rounds
    return refs


def assert_identical(target: Backend, prompt: list[int], ref: list[int], got: list[int], label):
    """On a mismatch, report the target's top-2 margin there: a near-tie means numerics."""
    if got == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if i is None:
        pytest.fail(f"{label}: length {len(got)} != {len(ref)}")
    target.reset()
    row = target.eval(prompt + ref[:i], all_logits=False)[-1]
    top = np.sort(row)[-2:]
    pytest.fail(
        f"{label}: first differs at token {i} (ref {ref[i]}, got {got[i]}); "
        f"top-2 logit margin there {top[1] - top[0]:.5f}"
    )


def test_prompt_lookup_greedy_identical_k1_to_8(target, prompts, references):
    draft = PromptLookupDraft()
    accepted = 0
    for prompt, ref in zip(prompts, references, strict=True):
        for k in range(1, 9):
            gen = generate(target, prompt, draft, k)
            assert_identical(target, prompt, ref, gen.token_ids, f"prompt-lookup k={k}")
            # Streamed text is the per-token bytes of exactly these tokens.
            assert gen.text == target.detokenize(gen.token_ids).decode("utf-8", "replace")
            accepted += gen.accepted
    assert accepted > 0, "prompt lookup never got a token accepted: nothing was verified"


@pytest.mark.parametrize("k", [1, 3, 6])
def test_torch_model_draft_greedy_identical(target, torch_draft, prompts, references, k):
    for prompt, ref in zip(prompts, references, strict=True):
        gen = generate(target, prompt, torch_draft, k)
        assert_identical(target, prompt, ref, gen.token_ids, f"torch q4_0 k={k}")
        assert gen.accepted > 0


@pytest.mark.parametrize("draft_file, k", [("q2_k", 3), ("q8_0", 6)])
def test_llama_draft_drives_torch_target(target, prompts, references, draft_file, k):
    be = load_backend(model_path(f"smollm2-135m-{draft_file}.gguf"), OPTIONS, kind="llama_cpp")
    try:
        draft = ModelDraft(f"llama-{draft_file}", be)
        for prompt, ref in zip(prompts, references, strict=True):
            gen = generate(target, prompt, draft, k)
            assert_identical(target, prompt, ref, gen.token_ids, f"llama {draft_file} k={k}")
            assert gen.accepted > 0
    finally:
        be.close()


def test_torch_draft_drives_llama_target(llama_target, torch_draft, prompts):
    prompt = prompts[1]
    ref = generate(llama_target, prompt).token_ids
    gen = generate(llama_target, prompt, torch_draft, 4)
    assert_identical(llama_target, prompt, ref, gen.token_ids, "torch q4_0 -> llama k=4")
    assert gen.accepted > 0


class WrongThenRight(Draft):
    """Fault injected on purpose: proposes the right token, then a wrong one (rejection)."""

    id = kind = "wrong-then-right"

    def __init__(self, truth: list[int], prompt_len: int, vocab: int):
        self.truth, self.prompt_len, self.vocab = truth, prompt_len, vocab

    def propose(self, context, k, params, rng):
        pos = len(context) - self.prompt_len
        if pos >= len(self.truth):
            return Proposal()
        good = self.truth[pos]
        return Proposal(tokens=[good, (good + 1) % self.vocab, good], key=self.id)


def test_kv_rollback_after_rejection_keeps_output_exact(target, prompts, references):
    prompt, ref = prompts[1], references[1]
    gen = generate(target, prompt, WrongThenRight(ref, len(prompt), target.n_vocab), 3)
    assert_identical(target, prompt, ref, gen.token_ids, "wrong-then-right")
    assert gen.proposed > gen.accepted > 0  # rounds were rejected and rolled back
    # The cache holds exactly the context minus the pending token: nothing rejected stays.
    assert target.tokens == (prompt + gen.token_ids)[: len(target.tokens)]
    assert target._cache.get_seq_length() == len(target.tokens)


def test_truncate_and_reuse_prefix_match_fresh_eval(target, prompts, references):
    seq = prompts[0] + references[0][:8]
    target.reset()
    fresh = target.eval(seq)
    assert fresh.shape == (len(seq), target.n_vocab) and fresh.dtype == np.float32

    def close(a: np.ndarray, b: np.ndarray) -> bool:
        return np.allclose(a, b, rtol=0.0, atol=2e-3)

    # Rejected candidates appended, then cropped away: the continuation is as if never there.
    n = len(seq) - 6
    target.reset()
    target.eval(seq[:n], all_logits=False)
    target.eval([11, 12, 13, 14])
    target.truncate(n)
    assert target._cache.get_seq_length() == n == len(target.tokens)
    assert close(target.eval(seq[n:]), fresh[n:])

    # reuse_prefix keeps the common prefix of a different continuation, drops the rest.
    m = len(seq) - 10
    assert target.reuse_prefix(seq[:m] + [7, 8, 9]) == m
    assert target._cache.get_seq_length() == m
    assert close(target.eval(seq[m:]), fresh[m:])

    # Last-row-only logits are the last row of the full ones.
    target.truncate(m)
    last = target.eval(seq[m:], all_logits=False)
    assert last.shape == (1, target.n_vocab) and close(last[0], fresh[-1])

    target.reset()
    assert target.tokens == [] and target._cache.get_seq_length() == 0
    assert close(target.eval(seq[:5]), fresh[:5])


def test_sampling_is_seeded(target, torch_draft, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    a = generate(target, prompts[1], torch_draft, 4, params)
    b = generate(target, prompts[1], torch_draft, 4, params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.proposed > 0


def test_text_and_numbers_match_llama_cpp(target, llama_target, prompts):
    """Same GGUF, same tokenizer behaviour, same chat prompt, logits within float noise."""
    ll = llama_target
    texts = [
        "Hello world",
        " leading space",
        "<|im_start|>user\nhi<|im_end|>\n",
        "émoji 🤖 ünïcödé 中文",
        "  multiple   spaces\n\n\ttabs",
        "def f(x):\n    return x**2  # 3.14159",
    ]
    for text in texts:
        for special in (False, True):
            assert target.tokenize(text, special=special) == ll.tokenize(text, special=special)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    assert target.chat_prompt(messages) == ll.chat_prompt(messages)
    assert target.eos_token_ids == ll.eos_token_ids and target.bos_token_id == ll.bos_token_id
    assert target.n_vocab == ll.n_vocab
    # Every token's bytes, pieces over 32 bytes included (the llama.cpp backend sizes its
    # buffer from llama_token_to_piece instead of llama-cpp-python's fixed 32 bytes).
    for tok in range(target.n_vocab):
        assert target.detokenize([tok]) == ll.detokenize([tok]), tok
    target.reset()
    ll.reset()
    a, b = target.eval(prompts[0]), ll.eval(prompts[0])
    assert np.abs(a - b).max() < 0.5
    assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() > 0.95


def test_describe_and_memory(target):
    d = target.describe()
    assert d["backend"] == "TorchBackend" and d["device"] == "cpu" and d["dtype"] == "float32"
    assert d["n_threads"] == torch.get_num_threads() == 1
    assert target.n_ctx == 512
    # 30 layers x 3 kv heads x 64 dims x K and V x 4 bytes
    assert target.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4
    assert 400e6 < target.weight_bytes() < 700e6  # 135M params in F32


def test_load_errors(tmp_path, monkeypatch):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + b"not really a model" * 4)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_backend(garbage, OPTIONS, kind="torch")
    truncated = tmp_path / "truncated.gguf"  # an interrupted copy: cut in the metadata
    with model_path("smollm2-135m-q4_0.gguf").open("rb") as f:
        truncated.write_bytes(f.read(300_000))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_backend(truncated, OPTIONS, kind="torch")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_backend(not_gguf, OPTIONS, kind="torch")
    with pytest.raises(ModelLoadError, match="not found"):
        load_backend(tmp_path / "missing.gguf", OPTIONS, kind="torch")
    # An install without accelerate: a clear message, before any weights are read.
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(ModelLoadError, match="accelerate"):
        load_backend(model_path(TARGET_FILE), OPTIONS, kind="torch")


def test_says_it_is_not_batch_invariant(target):
    """The flag the daemon warns on is true to the kernels: batched logits differ in the last
    bits from single steps (argmax the same here; a near-tie could still flip)."""
    toks = target.tokenize("The quick brown fox jumps over", add_bos=True)
    target.reset()
    batch = target.eval(toks)
    target.reset()
    singles = np.stack([target.eval([t])[0] for t in toks])
    target.reset()
    assert target.describe()["batch_invariant"] is False
    assert not np.array_equal(batch, singles)
    assert float(np.abs(batch - singles).max()) < 1e-3
