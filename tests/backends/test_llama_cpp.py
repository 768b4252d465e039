"""llama.cpp backend on the real SmolLM2 model: batched logits, KV truncation, text, bad files."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.backends.base import BackendOptions, load_backend
from memspec.errors import ContextOverflow, ModelLoadError
from memspec.paths import models_dir


def test_batch_logits_match_single_steps(small_backend):
    be = small_backend
    toks = be.tokenize("The quick brown fox jumps over", add_bos=True)
    batch = be.eval(toks)
    assert batch.shape == (len(toks), be.n_vocab) and be.tokens == toks
    be.reset()
    singles = np.stack([be.eval([t])[0] for t in toks])
    # Bit for bit: llama.cpp is built without llamafile (scripts/setup.sh), whose sgemm gave a
    # position different last bits in a batch than alone (up to 0.025 in a logit here).
    assert be.describe()["batch_invariant"], "llama-cpp-python has llamafile: run setup.sh"
    assert np.array_equal(batch, singles)


@pytest.mark.parametrize("repack", [False, True], ids=["plain-weights", "repacked-row-rule"])
def test_k_quant_target_is_batch_invariant_at_every_batch_size(repack):
    """Gemma 3 270M Q4_K_M: with weight repacking (from 4 rows) or ggml's tiled K-quant matmul
    (from 8 rows) a batch's logits differed from single steps by up to 1.3, and greedy output
    diverged at k >= 7. A target loads without the tiled matmul, and either without repacking
    or with it under the row rule; every batch size must equal single steps, read after a
    rollback as verification reads them."""
    from launcher import require_gemma

    options = BackendOptions(n_ctx=256, n_threads=1, weight_repack=repack, batch_invariant=True)
    be = load_backend(require_gemma(), options)
    try:
        assert be.describe()["batch_invariant"]
        assert be.describe()["weight_repack"] is repack  # Q4_K is repacked on x86 and ARM
        toks = be.tokenize(
            "The three primary colors are red, yellow and blue; mixed two at a time, they make "
            "the secondary colors orange, green and purple."
        )
        assert len(toks) >= 16
        be.eval(toks[:4])
        singles = np.stack([be.eval([t])[0] for t in toks[4:16]])
        for n in range(1, 13):
            be.truncate(4)
            assert np.array_equal(be.eval(toks[4 : 4 + n]), singles[:n]), f"batch of {n}"
        be.truncate(4)
        assert be.eval_argmax(toks[4:16]) == singles.argmax(axis=1).tolist()
    finally:
        be.close()


@pytest.mark.models
def test_drafts_repack_without_the_row_rule():
    """A draft's output is only a proposal: it keeps llama.cpp's repacked weights without the
    row rule's cost; without the rule a repacked model says it is not batch-invariant."""
    from memspec.scheduler.manifest_source import ManifestSource

    target_options = BackendOptions(n_ctx=256, n_threads=1, batch_invariant=True)
    draft_options = ManifestSource({}, target_options, "llama_cpp").options
    assert draft_options.weight_repack and not draft_options.batch_invariant
    be = load_backend(
        models_dir() / "smollm2-135m-q4_0.gguf",
        BackendOptions(n_ctx=128, n_threads=1, weight_repack=True),
    )
    try:
        assert not be.describe()["batch_invariant"]  # honest about what it runs
    finally:
        be.close()


def test_truncate_then_reeval_is_exact(small_backend):
    be = small_backend
    toks = be.tokenize("One two three four five six", add_bos=True)
    ref = be.eval(toks)[-1]
    be.truncate(3)
    assert be.tokens == toks[:3]
    again = be.eval(toks[3:])[-1]
    assert np.allclose(ref, again, atol=1e-4)
    assert be.reuse_prefix(toks[:4] + [123]) == 4 and be.tokens == toks[:4]


def test_prefill_returns_only_last_row(small_backend):
    toks = small_backend.tokenize("Hello there, general", add_bos=True)
    assert small_backend.eval(toks, all_logits=False).shape == (1, small_backend.n_vocab)


def test_context_overflow_is_refused_cleanly(small_backend):
    be = small_backend
    with pytest.raises(ContextOverflow):
        be.eval([42] * (be.n_ctx + 1))
    assert be.tokens == []  # nothing half-evaluated stays in the cache
    assert be.eval([42]).shape == (1, be.n_vocab)


def test_long_token_pieces_are_not_dropped(small_backend):
    text = "x" + " " * 40 + "y\n" + "-" * 64
    toks = small_backend.tokenize(text, add_bos=False)
    assert small_backend.detokenize(toks).decode() == text


def test_chat_template_from_gguf(small_backend):
    prompt = small_backend.chat_prompt([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("assistant")
    toks = small_backend.tokenize(prompt, special=True)
    assert 1 in toks  # <|im_start|> parsed as a control token, not as text


@pytest.mark.parametrize("content", [b"", b"not a gguf at all", None])
@pytest.mark.models
def test_bad_model_files(tmp_path, content):
    path = tmp_path / "bad.gguf"
    if content is None:  # a real GGUF truncated mid-tensor-data
        src = (models_dir() / "smollm2-135m-q2_k.gguf").read_bytes()
        path.write_bytes(src[: len(src) // 3])
    else:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        load_backend(path, BackendOptions(n_ctx=64))
    assert "bad.gguf" in err.value.message


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_backend(tmp_path / "nope.gguf")
