"""Grammar-constrained decoding (GBNF, JSON schema) with llama.cpp's own grammar engine.

A request's grammar (llama.cpp's GBNF, or a JSON schema the server turned into GBNF with
llama.cpp's converter: memspec/server/structured.py) is compiled once against the target's
vocabulary (`Grammar`); each sequence walks it with a `GrammarState`, a llama.cpp grammar
sampler.

Under speculation the state masks the target's logits at every verified position (tokens it
does not allow get -inf before temperature and the rest), and advances only on tokens the
target accepted, in order: a rejected candidate never reaches it, so rolling the KV back needs
no rollback of the grammar. Drafts propose freely; a proposal outside the grammar has
probability 0 under the masked target and is simply rejected.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import numpy as np

from memspec.engine.sampling import top_k_order
from memspec.errors import InvalidRequest

MAX_GRAMMAR_CHARS = 200_000  # a grammar is parsed on the engine thread: bound its size
# Greedy checks this many of a row's most likely tokens one by one, after its argmax, before
# the grammar's pass over the whole vocabulary (GrammarState.greedy).
SCAN_CANDIDATES = 32

# llama_token_data, as numpy lays it out: int32 id, float logit, float p (12 bytes).
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class _Vocab:
    """A GGUF's vocabulary alone (llama.cpp's vocab_only load: no weights, a few MB), which
    the grammar engine reads token pieces from. One per target file, for the process."""

    def __init__(self, path: Path):
        import llama_cpp
        import llama_cpp._logger  # noqa: F401 - llama.cpp's log through sys.stderr (redirectable)

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        with contextlib.redirect_stderr(io.StringIO()):  # llama.cpp's loader chatter
            self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise InvalidRequest(
                f"grammars need a GGUF target; {path.name} has no vocabulary llama.cpp reads",
                param="grammar",
            )
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.eos = llama_cpp.llama_vocab_eos(self.vocab)
        self._eog: dict[int, bool] = {}

    def is_eog(self, token: int) -> bool:
        """llama.cpp's end-of-generation tokens (EOS, EOT, <|endoftext|>...): what a grammar
        allows once it is complete, and nothing else is."""
        eog = self._eog.get(token)
        if eog is None:
            import llama_cpp

            eog = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))
        return eog


class _Captured:
    text = ""


@contextlib.contextmanager
def _stderr_captured() -> Iterator[_Captured]:
    """What C code writes to file descriptor 2 meanwhile (llama.cpp's grammar parser prints
    its errors there), kept from the daemon's log and handed back."""
    out = _Captured()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.text = tmp.read().decode("utf-8", "replace")


_vocab_lock = threading.Lock()


@lru_cache(maxsize=4)
def _vocab(path: str) -> _Vocab:
    return _Vocab(Path(path))


class Grammar:
    """A GBNF grammar checked against a target's vocabulary. InvalidRequest (param `param`)
    when llama.cpp cannot parse it."""

    def __init__(self, gbnf: str, model_path: Path, param: str = "grammar", root: str = "root"):
        if len(gbnf) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(
                f"grammar has {len(gbnf)} characters; the limit is {MAX_GRAMMAR_CHARS}",
                param=param,
            )
        self.gbnf, self.root, self.param = gbnf, root, param
        with _vocab_lock:
            self.vocab = _vocab(str(model_path))
        GrammarState(self, check=True).close()  # parse once now: a bad grammar is a 400

    def start(self) -> GrammarState:
        return GrammarState(self)

    def __repr__(self) -> str:
        return f"<Grammar {len(self.gbnf)} chars>"


class GrammarState:
    """Where one sequence is in its grammar: a llama.cpp grammar sampler. Engine thread only."""

    def __init__(self, grammar: Grammar, check: bool = False):
        """`check`: the first parse, whose errors the client gets (a valid grammar parses
        silently afterwards, so later states leave stderr alone)."""
        import llama_cpp

        self.vocab = grammar.vocab
        self._lib = llama_cpp
        with _stderr_captured() if check else contextlib.nullcontext(_Captured()) as log:
            self._smpl = llama_cpp.llama_sampler_init_grammar(
                grammar.vocab.vocab, grammar.gbnf.encode(), grammar.root.encode()
            )
        if not self._smpl:
            why = next((ln for ln in log.text.splitlines() if "error" in ln), "")
            raise InvalidRequest(
                f"the grammar does not parse as llama.cpp GBNF{': ' + why[:300] if why else ''}",
                param=grammar.param,
            )
        n = grammar.vocab.n_vocab
        self._full = np.zeros(n, dtype=_TOKEN_DATA)
        self._full["id"] = np.arange(n, dtype=np.int32)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    def _apply(self, data: np.ndarray) -> None:
        lib = self._lib
        arr = lib.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)),
            size=len(data),
            selected=-1,
            sorted=False,
        )
        lib.llama_sampler_apply(self._smpl, ctypes.byref(arr))

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (one candidate: no full-vocabulary pass)."""
        self._one["id"], self._one["logit"] = token, 0.0
        self._apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A float32 copy of a row of logits with every token the grammar refuses at -inf.
        The target's vocabulary may be padded past the tokenizer's: those ids are refused.
        Nothing allowed (a dead end): EOS alone, which ends the text."""
        out = np.full(len(logits), -np.inf, dtype=np.float32)
        n = min(len(logits), len(self._full))
        self._full["logit"][:n] = logits[:n]
        self._full["logit"][n:] = -np.inf
        self._apply(self._full)
        out[:n] = self._full["logit"][:n]
        if not np.isfinite(out).any():  # a dead end (or EOS banned at the end): end the text
            out[self.vocab.eos] = 0.0
        return out

    def greedy(self, logits: np.ndarray) -> int:
        """The argmax of the masked row: the first token the grammar allows in the row's
        stable descending order (ties: lower id first, as np.argmax). The row's own argmax,
        then the next SCAN_CANDIDATES, are checked one at a time (masking only removes
        tokens, so the first allowed is the masked argmax); only when none is allowed does
        the grammar pass over the whole vocabulary (~12 ms at 152k ids, where a candidate's
        check is ~10 µs). A dead end (nothing allowed) ends the text with EOS."""
        top = int(np.argmax(logits))
        if top < len(self._full) and self.allows(top):
            return top
        n = min(len(logits), len(self._full))
        for token in top_k_order(logits[:n], SCAN_CANDIDATES + 1).tolist():
            if token != top and self.allows(token):
                return token
        masked = self.mask(logits)
        top = int(np.argmax(masked))
        return top if np.isfinite(masked[top]) else self.vocab.eos

    def accept(self, token: int) -> None:
        """Advance past `token`, which the grammar allows (llama.cpp aborts on any other).
        End-of-generation tokens end the text: nothing to advance."""
        if not self.vocab.is_eog(token):
            self._lib.llama_sampler_accept(self._smpl, token)

    def is_eog(self, token: int) -> bool:
        return self.vocab.is_eog(token)

    def close(self) -> None:
        smpl, self._smpl = self._smpl, None
        if smpl:
            self._lib.llama_sampler_free(smpl)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
