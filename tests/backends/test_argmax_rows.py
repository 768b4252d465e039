"""Greedy verification reads rows up to the first rejection only (each row read is a pass
over the whole vocabulary), and agrees with every row's argmax on what it reads."""

from __future__ import annotations

import numpy as np

from memspec.backends.base import argmax_rows
from memspec.engine.speculative import accept_greedy
from memspec_lab.stub_backend import StubBackend


def test_rows_stop_at_the_first_disagreement():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    full = logits.argmax(axis=1).tolist()
    assert argmax_rows(logits) == full
    assert argmax_rows(logits, []) == full
    for first_wrong in range(6):
        drafted = full[:5]
        if first_wrong < 5:
            drafted[first_wrong] = (drafted[first_wrong] + 1) % 1000
        best = argmax_rows(logits, drafted)
        assert best == full[: first_wrong + 1]  # that row read, none after it
        assert accept_greedy(drafted, best) == accept_greedy(drafted, full)


def test_eval_argmax_reads_no_row_past_a_rejection(tmp_path):
    stub = StubBackend(tmp_path / "stub.gguf", n_vocab=2048, n_ctx=128)
    c = stub.cycle
    stub.eval([1] + c[:4], all_logits=False)
    drafted = [c[5], 7, c[7]]  # the second proposal is wrong: rows 0 and 1 are read
    reads: list[int] = []
    forward = stub._forward_seq

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        rows, feats = forward(*args, **kwargs)
        reads.append(len(rows))
        return rows, feats

    stub._forward_seq = counted  # type: ignore[method-assign]
    assert stub.eval_argmax([c[4]] + drafted, drafted) == [c[5], c[6]]
    assert reads == [4]  # the pass still scores every token; only two rows are reduced
    assert stub.tokens[-4:] == [c[4]] + drafted  # the caller truncates what it rejects
