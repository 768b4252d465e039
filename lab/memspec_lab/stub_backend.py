"""A target backend whose step costs next to nothing, for `memspec bench runtime` (the runtime's
own cost per token, memspec_lab.bench.runtime_cost) and for tests that need a target without a
model: greedy decoding over it walks a fixed cycle of tokens, which a prompt-lookup draft finds
in the prompt and always gets right."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from memspec.backends.base import Backend, BackendOptions, SequenceContext
from memspec.backends.chat import CHATML, ChatTemplate

# The stub's cycle: consecutive ids from here, none a control token in any vocabulary we ship.
STUB_CYCLE_START = 1000
STUB_CYCLE_LEN = 32
# A stub step's sweep in the `cold` runs: more than the largest last-level cache we target
# (32 MiB on the 2-core EPYC testbed, 4 MiB on a Jetson Orin), as a model's weights are.
COLD_SWEEP_MIB = 64


class StubBackend(SequenceContext):
    """A target whose step costs next to nothing: the row for input token t is precomputed, its
    argmax the token after t in a fixed cycle (STUB_CYCLE_*), over a vocabulary of the real
    target's size. Rows for consecutive cycle tokens are a view of one table (a doubled cycle,
    so a round's rows never wrap). The step's time is counted as decode_s, the model's share,
    not the runtime's: with `sweep_mib`, a sweep of that many MiB that leaves the caches cold
    as a model's weights do, then the rows written into an output buffer the engine reads as a
    view, as llama.cpp's decode ends by writing the logits it hands back (so they are as warm
    as a real step's, while the runtime's own code and data are cold)."""

    def __init__(self, path: Path, n_vocab: int, n_ctx: int, sweep_mib: int = 0):
        super().__init__()
        self.path, self.options, self.metadata = path, BackendOptions(n_ctx=n_ctx), {}
        self.n_ctx, self.n_vocab, self.n_embd = n_ctx, n_vocab, 1
        self.bos_token_id, self.eos_token_ids = None, frozenset({0})
        self._slots: list[Backend] = [self]
        self.cycle = list(range(STUB_CYCLE_START, STUB_CYCLE_START + STUB_CYCLE_LEN))
        rng = np.random.default_rng(0)  # a spread-out row: sampling pays a real softmax
        table = np.tile(rng.standard_normal(n_vocab).astype(np.float32), (2 * STUB_CYCLE_LEN, 1))
        for j in range(2 * STUB_CYCLE_LEN):
            table[j, self.cycle[(j + 1) % STUB_CYCLE_LEN]] = 30.0
        table.flags.writeable = False
        self.table = table
        self._pieces: dict[int, bytes] = {}
        self.sweep_mib = sweep_mib
        self._sweep = np.ones(COLD_SWEEP_MIB << 18, dtype=np.float32)
        self._logits = np.empty((2 * STUB_CYCLE_LEN, n_vocab), dtype=np.float32)

    @property
    def chat_template(self) -> ChatTemplate:  # it renders no chat: no warning for lacking one
        return ChatTemplate("stub", jinja=CHATML)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return [STUB_CYCLE_START + b % STUB_CYCLE_LEN for b in text.encode()]

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self._piece(t) for t in tokens)

    def _piece(self, token: int) -> bytes:  # cached as llama.cpp's backend caches its pieces
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = b" w%d" % token
        return piece

    def _forward_seq(
        self, seq_id: int, n_past: int, tokens: list[int], all_logits: bool, copy: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        t = time.perf_counter()
        if self.sweep_mib:
            float(self._sweep[: self.sweep_mib << 18].sum())
        idx = [(tok - STUB_CYCLE_START) % STUB_CYCLE_LEN for tok in tokens]
        if not all_logits:
            idx = idx[-1:]
        j, n = idx[0], len(idx)
        if n <= STUB_CYCLE_LEN and idx == [(j + i) % STUB_CYCLE_LEN for i in range(n)]:
            rows = self.table[j : j + n]  # the doubled cycle: rows past its end repeat it
        else:  # not a run of the cycle (a prompt, a wrong draft): rows by index
            rows = self.table[idx]
        if self.sweep_mib and len(rows) <= len(self._logits):  # written last, as llama.cpp's
            out = self._logits[: len(rows)]
            np.copyto(out, rows)
            if copy:
                out = out.copy()
        else:
            out = rows.copy() if copy else rows
        self.decode_s += time.perf_counter() - t
        return out, None

    def _truncate_seq(self, seq_id: int, n: int) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"backend": "stub", "file": self.path.name, "batch_invariant": True}
