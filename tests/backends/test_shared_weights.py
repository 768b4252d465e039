"""One loaded llama_model per file and load parameters (memspec.backends.shared_weights), on the
real Gemma 3 270M Q4_K_M (its weights are repacked for the CPU kernels, so the repacking note
must reach a backend that joins another's load) and the SmolLM2 Q4_0 draft."""

from __future__ import annotations

import dataclasses

import numpy as np
import psutil
import pytest
from launcher import require_gemma

from memspec.backends.base import BackendOptions, load_backend
from memspec.backends.shared_weights import SHARED_MODELS, weights_key
from memspec.memory.footprint import vocab_bytes
from memspec.memory.gguf_info import read_shape
from memspec.paths import models_dir

TEXT = "The three primary colors are red, yellow and blue; mixed two at a time"
TARGET = BackendOptions(n_ctx=256, n_threads=1, weight_repack=True, batch_invariant=True)
DRAFT = dataclasses.replace(TARGET, batch_invariant=False, role="draft")


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_a_target_joins_a_drafts_weights_and_decodes_as_if_alone():
    path = require_gemma()
    lone = load_backend(path, TARGET)
    toks = lone.tokenize(TEXT)
    alone = lone.eval(toks)
    lone.close()
    assert SHARED_MODELS.holders(path) == []

    draft = load_backend(path, DRAFT)
    before = rss()
    target = load_backend(path, TARGET)
    grown = rss() - before
    try:
        weights = read_shape(path).weight_bytes
        print(f"weights {weights / 2**20:.0f} MiB; the second holder added {grown / 2**20:.1f} MiB")
        assert target.shares_weights and not draft.shares_weights
        assert grown < weights / 4
        assert sorted(SHARED_MODELS.holders(path)) == ["draft", "target"]
        assert SHARED_MODELS.held_as(weights_key(path, TARGET), "target")
        # The first load's log said the weights were repacked: the joined target knows it, so
        # the row rule keeps its logits independent of the batch.
        assert target.repacked and target.describe()["batch_invariant"]
        draft.eval(draft.tokenize("Something else entirely, in the draft's own context"))
        assert np.array_equal(target.eval(toks), alone)
        target.truncate(0)
        singles = np.stack([target.eval([t])[0] for t in toks])
        assert np.array_equal(singles, alone)
    finally:
        draft.close()  # the first holder leaves: the weights stay for the other
    try:
        target.truncate(0)
        assert np.array_equal(target.eval(toks), alone)
        assert SHARED_MODELS.holders(path) == ["target"]
    finally:
        target.close()
    assert SHARED_MODELS.holders(path) == []


@pytest.mark.models
def test_other_load_parameters_and_private_loads_load_their_own_copy():
    path = models_dir() / "smollm2-135m-q4_0.gguf"
    a = load_backend(path, TARGET)
    b = load_backend(path, dataclasses.replace(TARGET, weight_repack=False))
    # A load whose own cost is measured (traces, probes, live policies) reads the file.
    c = load_backend(path, dataclasses.replace(TARGET, share_weights=False))
    try:
        assert not a.shares_weights and not b.shares_weights and not c.shares_weights
        assert weights_key(path, TARGET) != weights_key(path, b.options)
    finally:
        a.close()
        b.close()
        c.close()
    assert SHARED_MODELS.holders(path) == []


@pytest.mark.models
def test_a_draft_on_a_served_models_weights_is_charged_its_context_only():
    """ManifestSource.footprint: the target role pays for shared weights and vocabulary."""
    from memspec.drafts.manifest import DraftManifest
    from memspec.scheduler.manifest_source import ManifestSource

    path = models_dir() / "smollm2-135m-q4_0.gguf"
    manifest = DraftManifest(id="q4_0", kind="model", file=path.name)
    source = ManifestSource({"q4_0": manifest}, TARGET, "llama_cpp")
    alone = source.footprint("q4_0")
    assert alone.weights == read_shape(path).weight_bytes
    served = load_backend(path, TARGET)
    try:
        shared = source.footprint("q4_0")
        assert shared.weights == 0 and shared.kv == alone.kv
        assert alone.total - shared.total == alone.weights + vocab_bytes(read_shape(path))
    finally:
        served.close()
    assert source.footprint("q4_0") == alone
