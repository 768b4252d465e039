"""Target features (issue 11): the final hidden state of every row eval returns, on the real
SmolLM2 F32 model (and Gemma 3 270M for a K-quant target).

What is checked: which tensor it is (the output layer's input: hidden @ output matrix gives the
logits), that it is batch-invariant bit for bit as the logits are, that turning it on leaves
the logits bit-identical, and that it is off (and says so) unless asked for.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from launcher import TARGET_FILE, require_gemma, require_testbed

from memspec.backends.base import BackendOptions, FeaturesDisabled, load_backend
from memspec.drafts.gguf_header import open_header
from memspec.paths import models_dir

TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village"
OFF = BackendOptions(n_ctx=128, n_threads=1)
ON = BackendOptions(n_ctx=128, n_threads=1, features=True)


def target_path():
    require_testbed()
    return models_dir() / TARGET_FILE


@pytest.fixture(scope="module")
def on():
    be = load_backend(target_path(), ON)
    yield be
    be.close()


@pytest.fixture(scope="module")
def off():
    be = load_backend(target_path(), OFF)
    yield be
    be.close()


@pytest.fixture(scope="module")
def toks(on) -> list[int]:
    t = on.tokenize(TEXT)
    assert len(t) >= 16
    return t


def output_matrix(path, rows: slice = slice(None)) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The GGUF's output layer (token_embd when the embeddings are tied), dequantized, and
    its type. The header reader skips parsing the tokenizer's arrays (Gemma's take ~20 s)."""
    tensors = {t.name: t for t in open_header(path).tensors}
    t = tensors.get("output.weight") or tensors["token_embd.weight"]
    return dequantize(np.asarray(t.data)[rows], t.tensor_type).astype(np.float32), t.tensor_type


def test_off_by_default_and_says_so(off, toks):
    off.reset()
    off.eval(toks[:4])
    with pytest.raises(FeaturesDisabled, match="features=True"):
        off.last_features()
    assert isinstance(FeaturesDisabled("x"), RuntimeError)
    assert "features" not in off.describe()  # calibration keys of plain targets unchanged


def test_rows_match_the_logits_rows(on, toks):
    on.reset()
    logits = on.eval(toks)
    feats = on.last_features()
    assert on.n_embd == 576
    assert feats.shape == (len(toks), on.n_embd) and feats.dtype == np.float32
    assert not feats.flags.writeable
    on.eval(toks[:3])  # a later eval leaves the array taken earlier as it was
    assert feats.shape == (len(toks), on.n_embd)
    assert on.last_features().shape == (3, on.n_embd)
    on.reset()
    last = on.eval(toks, all_logits=False)
    assert last.shape == (1, on.n_vocab) and on.last_features().shape == (1, on.n_embd)
    assert np.array_equal(last, logits[-1:])
    assert np.array_equal(on.last_features(), feats[-1:])
    assert on.describe()["features"] is True


def test_features_are_the_output_layer_input(on, toks):
    """SmolLM2 ties its output to token_embd: features @ token_embd.T is the logits (F32, so
    only the summation order differs)."""
    on.reset()
    logits = on.eval(toks)
    w, kind = output_matrix(on.path)
    assert kind == GGMLQuantizationType.F32
    got = on.last_features() @ w.T
    assert np.abs(got - logits).max() < 1e-4 * max(1.0, np.abs(logits).max())
    # After the final RMS norm (its weight rescales columns, so rows are not unit RMS, but
    # not the residual stream either, whose scale grows with depth).
    assert np.isfinite(on.last_features()).all()


def test_batch_equals_single_steps_bit_for_bit(on, toks):
    on.reset()
    batch_logits = on.eval(toks)
    batch = on.last_features()
    on.reset()
    singles, single_logits = [], []
    for t in toks:
        single_logits.append(on.eval([t]))
        singles.append(on.last_features())
    assert np.array_equal(np.concatenate(singles), batch)
    assert np.array_equal(np.concatenate(single_logits), batch_logits)


def test_logits_unchanged_by_features(on, off, toks):
    for be in (on, off):
        be.reset()
    # a prefill (its last token decoded apart with features on) then a verify-sized batch
    a = on.eval(toks[:10], all_logits=False)
    b = off.eval(toks[:10], all_logits=False)
    assert np.array_equal(a, b)
    assert np.array_equal(on.eval(toks[10:16]), off.eval(toks[10:16]))
    assert on.eval_argmax(toks[16:]) == off.eval_argmax(toks[16:])


def test_prefill_over_several_chunks(toks):
    """A prompt longer than one batch (and its last token decoded apart, which features
    mode does for a prefill): only the last row comes back, with the bits of one batch."""
    opts = BackendOptions(n_ctx=64, n_threads=1, features=True)
    be = load_backend(target_path(), opts)
    try:
        assert be.last_features().shape == (0, be.n_embd)  # no eval yet
        assert be._n_batch == 64
        prompt = (toks * 4)[:60]
        be._n_batch = 16  # several chunks without a long prompt
        last = be.eval(prompt, all_logits=False)
        feats = be.last_features()
        be._n_batch = 64
        be.reset()
        whole = be.eval(prompt)
        assert np.array_equal(last, whole[-1:])
        assert np.array_equal(feats, be.last_features()[-1:])
        be._n_batch = 16  # and all rows, across chunks
        be.reset()
        assert np.array_equal(be.eval(prompt), whole)
        assert be.last_features().shape == (60, be.n_embd)
    finally:
        be.close()


def test_truncate_and_reeval_gives_the_same_features(on, toks):
    on.reset()
    on.eval(toks)
    full = on.last_features()
    on.truncate(8)
    on.eval(toks[8:])
    assert np.array_equal(on.last_features(), full[8:])
    # after a rollback of rejected candidates (other tokens evaluated, then dropped)
    on.truncate(8)
    on.eval([toks[3]] * 5)
    on.truncate(8)
    on.eval(toks[8:12])
    assert np.array_equal(on.last_features(), full[8:12])


def test_gemma_features_batch_invariant_and_logits_unchanged():
    """Gemma 3 270M Q4_K_M (262k vocabulary, K-quant weights, repacked): a features target
    keeps the row rule, so features and logits of a 9-row batch (one the tiled matmul would
    take whole) equal single steps, logits are those of a features-off load, and features @
    output rows give the logits. A prompt that ends on a whole block of the rule returns its
    logits and no feature (its pass ran the block kernels; embeddings mode would run its last
    layer on all 8 rows)."""
    path = require_gemma()
    ruled = BackendOptions(n_ctx=64, n_threads=1, weight_repack=True, batch_invariant=True)
    on = load_backend(path, replace(ruled, features=True))
    off = load_backend(path, ruled)
    try:
        assert on.describe()["batch_invariant"] and on.describe()["weight_repack"]
        toks = on.tokenize(TEXT)[:20]
        assert len(toks) == 20
        # A prompt of 11 (a block, then 3 rows): the last row's feature, as a cold single step.
        assert np.array_equal(on.eval(toks[:11], all_logits=False), off.eval(toks[:11], False))
        prompt_feature = on.last_features()
        assert prompt_feature.shape == (1, on.n_embd)
        on.truncate(10)
        on.eval([toks[10]])
        assert np.array_equal(on.last_features(), prompt_feature)
        batch = on.eval(toks[11:])
        feats = on.last_features()
        assert np.array_equal(batch, off.eval(toks[11:]))
        on.truncate(11)
        singles = []
        for t in toks[11:]:
            on.eval([t])
            singles.append(on.last_features())
        assert np.array_equal(np.concatenate(singles), feats)
        # A prompt of 16, two whole blocks: the logits of a features-off load, no feature.
        on.reset()
        off.reset()
        assert np.array_equal(on.eval(toks[:16], all_logits=False), off.eval(toks[:16], False))
        assert on.last_features().shape == (0, on.n_embd)
        # ggml multiplies a Q8_0 matrix by activations quantized to Q8_0 as well: quantized
        # so, the features give the logits to float rounding (raw, only to ~0.2 in 25).
        cols = slice(0, 2048)  # a slice of the 262k-row output matrix is enough to check
        w, kind = output_matrix(path, cols)
        assert kind == GGMLQuantizationType.Q8_0
        as_ggml = dequantize(quantize(feats, kind), kind)
        assert np.abs(as_ggml @ w.T - batch[:, cols]).max() < 1e-4 * np.abs(batch).max()
    finally:
        on.close()
        off.close()


@pytest.mark.torch
def test_torch_features_match_llama_cpp(on, toks):
    """Different kernels (transformers' eager F32 vs ggml): close, not equal."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tb = load_backend(target_path(), ON, kind="torch")
    try:
        on.reset()
        on.eval(toks)
        want = on.last_features()
        logits = tb.eval(toks)
        got = tb.last_features()
        assert got.shape == want.shape == (len(toks), tb.n_embd)
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
        assert np.abs(got @ output_matrix(tb.path)[0].T - logits).max() < 1e-3
        tb.reset()
        tb.eval(toks, all_logits=False)
        assert np.allclose(tb.last_features(), got[-1:], atol=1e-4)
    finally:
        tb.close()
