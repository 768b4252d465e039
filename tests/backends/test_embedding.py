"""The embedding context's plan and the vector arithmetic the routes apply (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.backends.embedding import (
    EMBED_BATCH,
    POOLING_CLS,
    POOLING_LAST,
    POOLING_MEAN,
    l2_normalize,
    plan_embedding,
    shorten,
)
from memspec.errors import ModelLoadError


def test_a_generative_model_gets_last_token_pooling_in_chunks():
    plan = plan_embedding({"general.architecture": "llama", "llama.context_length": 8192}, 2048)
    assert plan.pooling == POOLING_LAST and not plan.from_model
    assert plan.n_ctx == 2048 and plan.n_batch == EMBED_BATCH  # the KV carries the chunks


def test_the_models_own_pooling_reads_the_whole_input_at_once():
    meta = {"general.architecture": "bert", "bert.pooling_type": "1", "bert.context_length": 512}
    plan = plan_embedding(meta | {"bert.attention.causal": "false"}, 2048)
    assert plan.pooling == POOLING_MEAN and plan.from_model and not plan.causal
    assert plan.n_ctx == plan.n_batch == 512  # capped at the trained context, one ubatch
    cls = plan_embedding({"general.architecture": "x", "x.pooling_type": 2}, 300)
    assert cls.pooling == POOLING_CLS and cls.n_batch == 300
    with pytest.raises(ModelLoadError, match="reranker"):
        plan_embedding({"general.architecture": "x", "x.pooling_type": 4}, 300)


def test_normalise_and_shorten():
    v = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    assert np.allclose(l2_normalize(v), v / 13)
    assert np.allclose(shorten(l2_normalize(v), 2), [0.6, 0.8])  # cut, then unit again
    assert shorten(v, None) is v and shorten(v, 3) is v
    assert not l2_normalize(np.zeros(4)).any()  # a zero vector stays zero
    with pytest.raises(ValueError, match="NaN"):
        l2_normalize(np.array([1.0, np.nan]))
