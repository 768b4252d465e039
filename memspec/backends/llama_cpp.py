"""llama-cpp-python backend: batched decode with per-position logits, KV truncation by seq_rm.

We drive llama.cpp's context directly (one sequence, our own batches) and use `Llama` only to
load the model, its tokenizer and its metadata. Logits are requested per token in the batch,
so a prefill pays for one row and a verification for k+1.

Lossless needs batch invariance: a position's logits must not depend on how many tokens share
its batch, or a verification of k+1 tokens can flip a near-tie that single-token decoding
resolves the other way. llama.cpp's CPU matmuls are invariant (one dot product per output, the
same order for any batch) except three paths that sum in another order for a batch than for
one row:
- llamafile's sgemm, which `scripts/setup.sh` builds out (`-DGGML_LLAMAFILE=OFF`);
- weight repacking (Q4_0, Q4_K, IQ4_NL...): a matmul over a batch runs its rows in groups of
  4 through a gemm kernel and the rest (fewer than 4) through gemv (logits differ by up to
  ~0.7 on Qwen2.5-Coder 1.5B Q4_K_M);
- ggml's tiled K-quant matmul (x86; Q2_K..Q6_K and IQ types llama.cpp did not repack, Q6_K in
  a Q4_K_M file): a pass of 8 rows or more goes through it whole, fewer through vec_dot.
A target keeps the last two's prompt speed (the tiled matmul: 1.25x prompt tokens/s on the
1.5B, `memspec bench kernels`) under the *row rule* (BackendOptions.batch_invariant), which
gives every position the kernels a cold plain decoding gives it: a prompt pass that ends at
`end` computes [0, end - end % 8) in passes of whole blocks of 8 rows aligned at position 0
(gemm and tiled on every row) and the rest as generation rows; generation passes have at most
3 rows (7 without repacked weights), gemv and vec_dot as in a single-token decode.
`prompt_pass_start` says what of a cached sequence must be computed again for that; each
sequence keeps how far its block prefix reaches. `batch_invariant()` says whether this
process has llamafile out and the tiled matmul not forced below its floor.

Features (BackendOptions.features): the final hidden state of each returned row, read from
llama.cpp's embeddings mode (its `t_embd`, the output layer's input), on only for the batches
whose rows are returned. The graph is the same with it on, so logits keep their bits; under
the row rule that holds for generation passes only (each row on one-row kernels, whatever a
pass outputs), so a prompt that ends on a whole block returns no feature.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from memspec.backends.base import (
    Backend,
    BackendOptions,
    KVSnapshot,
    SequenceContext,
    SequenceSlot,
    llama_kv_layout,
)
from memspec.backends.shared_weights import SHARED_MODELS, SharedModel, WeightsKey, weights_key
from memspec.errors import ModelLoadError
from memspec.kv_cache import ggml_type, sliding_window


def batch_invariant() -> bool:
    """Whether llama.cpp's CPU kernels, under the row rule, give a position the same logits in
    any batch shape: llamafile's sgemm built out, and the tiled matmul not forced below 8 rows
    (GGML_CPU_TILED_MM_FORCE, a test switch of ggml's)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return "LLAMAFILE = 1" not in info and not _env_flag("GGML_CPU_TILED_MM_FORCE", False)


def _env_flag(name: str, default: bool) -> bool:
    """A ggml switch as ggml reads it: unset is the default, else atoi(value) != 0."""
    value = os.environ.get(name)
    if value is None:
        return default
    leading = re.match(r"\s*[+-]?(\d+)", value)
    return leading is not None and int(leading.group(1)) != 0


# llama.cpp's repacked matmul runs a batch's rows in groups of GEMM_ROWS through its gemm
# kernel and the remainder through gemv (ggml-cpu/repack.cpp, forward_mul_mat_one_chunk).
GEMM_ROWS = 4
# ggml's tiled K-quant matmul takes a whole pass of at least TILED_MIN_ROWS rows
# (ggml-cpu/tiled/tiled.cpp, ggml_tiled_min_batch), for the weight types in TILED_TYPES that
# were not repacked; GGML_CPU_TILED_MM=0 turns it off.
TILED_MIN_ROWS = 8
TILED_TYPES = frozenset(
    {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S"}
    | {"IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"}
)
# A pass of whole blocks (a multiple of BLOCK_ROWS rows) meets gemm and the tiled matmul on
# every row; a pass of fewer than GEMM_ROWS rows meets neither.
BLOCK_ROWS = 8


def prompt_pass_start(n_past: int, end: int, block_prefix: int) -> int:
    """Where a prompt pass that extends a sequence of `n_past` cached positions to `end` must
    start so that every position gets the kernels a cold pass over [0, end) gives it: whole
    blocks below `body` = end rounded down to BLOCK_ROWS, aligned at 0; rows from there.
    `block_prefix`: how many leading cached positions blocks computed (the rest, rows)."""
    body = end - end % BLOCK_ROWS
    start = n_past
    if block_prefix < min(n_past, body):  # cached positions rows computed that need blocks
        start = block_prefix
    if n_past > body and block_prefix > body:  # cached positions blocks computed that need rows
        start = min(start, body)
    if start < body:  # blocks are aligned at position 0
        start -= start % BLOCK_ROWS
    return start


def _repacked(load_log: str) -> bool:
    """Whether llama.cpp put any weights in its repacked buffer (its load log names it)."""
    return "CPU_REPACK model buffer size" in load_log


def _weight_types(load_log: str) -> set[str]:
    """The weight types the model's file holds (its load log lists them: `- type q6_K: ...`)."""
    return {m.upper() for m in re.findall(r"- type\s+(\w+):\s+\d+ tensors", load_log)}


_params_lock = threading.Lock()


@contextlib.contextmanager
def _load_params(
    weight_repack: bool, n_seq: int, devices: list[int], key: WeightsKey, role: str
) -> Iterator[None]:
    """Load with llama.cpp's weight repacking (`use_extra_bufts`) on or off, and a context of
    `n_seq` sequences on per-sequence KV streams (`kv_unified` off: a unified cache gives a
    sequence other logits when others share its batch; measured). `Llama` takes neither as
    an argument: its parameters start from llama_model_default_params and
    llama_context_default_params, which we wrap for the load (under a lock, so two loads
    never see each other's choice). Its model comes from SHARED_MODELS: weights another
    backend loaded with the same `key` are taken, not loaded again."""
    import llama_cpp._internals as internals
    import llama_cpp.llama_cpp as lib

    with _params_lock:
        model_default = lib.llama_model_default_params
        context_default = lib.llama_context_default_params
        model_class = internals.LlamaModel

        # The devices layers are offloaded to (RPC workers), NULL-terminated; kept alive by
        # the closure for the load.
        device_array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)

        def model_params():  # type: ignore[no-untyped-def]
            p = model_default()
            p.use_extra_bufts = weight_repack
            if devices:
                p.devices = ctypes.cast(device_array, ctypes.c_void_p)  # declared void*
            return p

        def context_params():  # type: ignore[no-untyped-def]
            p = context_default()
            p.n_seq_max = n_seq
            p.kv_unified = False
            return p

        def shared_model(**kwargs: Any) -> SharedModel:
            return SHARED_MODELS.open(key, role, lambda: model_class(**kwargs))

        lib.llama_model_default_params = model_params
        lib.llama_context_default_params = context_params
        internals.LlamaModel = shared_model
        try:
            yield
        finally:
            lib.llama_model_default_params = model_default
            lib.llama_context_default_params = context_default
            internals.LlamaModel = model_class


class LlamaCppBackend(SequenceContext):
    def __init__(self, path: Path, options: BackendOptions):
        super().__init__()
        import llama_cpp

        self.path = path
        self.options = options
        # llama.cpp runs single-token batches on n_threads and larger ones on n_threads_batch;
        # llama-cpp-python defaults the former to half the cores, which makes plain decoding
        # look slower than verification. Use the same count for both.
        n_threads = options.n_threads or os.cpu_count() or 1
        self.n_threads = n_threads
        # Features are read per token (no pooling): a model whose GGUF names a pooling (an
        # embedding model) would otherwise hand back one pooled row per sequence.
        extra = {"pooling_type": llama_cpp.LLAMA_POOLING_TYPE_NONE} if options.features else {}
        devices, n_gpu_layers, split = self._rpc_devices(path, options)
        try:
            # llama.cpp prints loader chatter on stderr; keep it unless loading fails.
            buf = io.StringIO()
            n_seq = max(1, options.n_seq)
            with (
                contextlib.redirect_stderr(buf),
                _load_params(
                    options.weight_repack, n_seq, devices, weights_key(path, options), options.role
                ),
            ):
                # verbose: the load log (in buf) says which weight types the file holds and
                # whether any were repacked.
                self._llm = llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=options.n_ctx * n_seq,  # n_ctx per sequence
                    n_batch=min(options.n_ctx * n_seq, 512),
                    n_threads=n_threads,
                    n_threads_batch=n_threads,
                    n_gpu_layers=n_gpu_layers,
                    tensor_split=split,
                    use_mmap=options.use_mmap,
                    logits_all=False,
                    seed=options.seed,
                    type_k=ggml_type(options.kv_cache.type_k),
                    type_v=ggml_type(options.kv_cache.type_v),
                    flash_attn=options.kv_cache.flash_attn,
                    swa_full=options.kv_cache.swa_full,
                    verbose=True,
                    **extra,
                )
                from llama_cpp._logger import set_verbose

                set_verbose(False)  # llama.cpp's later logs stay quiet
                self._llm.verbose = False  # and llama-cpp-python's own
        except Exception as e:  # llama.cpp reports a corrupt file as a bare ValueError
            raise ModelLoadError(f"failed to load {path.name}: {e}", param="model") from e
        # What each slot holds (llama.cpp rounds a sequence's context up to 256 cells).
        self.n_ctx = self._llm.n_ctx() // n_seq
        self.n_vocab = self._llm.n_vocab()
        self.n_embd = llama_cpp.llama_model_n_embd_out(self._llm._model.model)
        # Created without embeddings (Llama's default): _forward turns them on per batch.
        self._embeddings_on = False
        self._pieces: dict[int, bytes] = {}
        self._n_batch = self.max_batch = self._llm.n_batch
        meta = self._llm.metadata
        self.metadata = meta
        bos, eos = self._llm.token_bos(), self._llm.token_eos()
        self.bos_token_id = bos if bos >= 0 else None
        self.eos_token_ids = _end_of_generation_ids(self._llm._model.vocab, self.n_vocab)
        self._add_bos = meta.get("tokenizer.ggml.add_bos_token", "true") == "true"
        self._bos_text = self._llm._model.token_get_text(bos) if bos >= 0 else ""
        self._eos_text = self._llm._model.token_get_text(eos) if eos >= 0 else ""
        arch = meta.get("general.architecture", "llama")
        self.n_layers = int(meta.get(f"{arch}.block_count", 0))
        n_head = int(meta.get(f"{arch}.attention.head_count", 1))
        self.n_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
        head_dim = int(meta.get(f"{arch}.embedding_length", 0)) // max(n_head, 1)
        # Gemma 3 and others set the head size apart from embedding / heads (270M: 256 vs 160).
        self.head_dim_k = int(meta.get(f"{arch}.attention.key_length", head_dim))
        self.head_dim_v = int(meta.get(f"{arch}.attention.value_length", head_dim))
        self._slots: list[Backend] = [self] + [SequenceSlot(self, i) for i in range(1, n_seq)]
        # Whether llama.cpp repacked is in the log of the load that read the weights: a backend
        # that joined another's load (shared_weights) reads the first one's note.
        shared: SharedModel = self._llm._model
        if shared.fresh:
            shared.notes["repacked"] = options.weight_repack and _repacked(buf.getvalue())
            shared.notes["weight_types"] = _weight_types(buf.getvalue())
        self.repacked = bool(shared.notes.get("repacked", False))
        self.shares_weights = not shared.fresh
        # The row rule (module docstring): only where repacked weights or the tiled matmul
        # make the batch matter. A generation pass stays below both kernels' floors.
        weight_types: set[str] = shared.notes.get("weight_types", set())
        tiled_on = _env_flag("GGML_CPU_TILED_MM", True)
        self.tiled = tiled_on and not TILED_TYPES.isdisjoint(weight_types)
        multi_row = self.repacked or self.tiled
        self._row_rule = multi_row and options.batch_invariant
        self._row_pass = GEMM_ROWS - 1 if self.repacked else TILED_MIN_ROWS - 1
        self._block_prefix = [0] * n_seq  # per sequence: positions whole blocks computed
        # A sliding window whose layers keep only it (KVCache.swa_full off): 0 when none.
        n_swa = llama_cpp.llama_model_n_swa(self._llm._model.model)
        self._n_swa = 0 if options.kv_cache.swa_full else max(0, n_swa)

    def _rpc_devices(
        self, path: Path, options: BackendOptions
    ) -> tuple[list[int], int, list[float] | None]:
        """(devices, n_gpu_layers, tensor_split) for llama.cpp. With RPC workers: their
        devices, and options.tensor_split's weight for each worker on its first device
        (options.n_gpu_layers says how many layers leave this device; the runtime splits)."""
        if not options.rpc:
            return [], options.n_gpu_layers, None
        from memspec.rpc.endpoints import check_reachable
        from memspec.rpc.ggml import remote_devices

        weights_in = list(options.tensor_split) or [1.0] * len(options.rpc)
        devices: list[int] = []
        weights: list[float] = []
        for endpoint, weight in zip(options.rpc, weights_in, strict=True):
            check_reachable(endpoint)  # ggml aborts the process on a failed connection
            found = remote_devices(endpoint)
            devices += found
            weights += [weight] + [0.0] * (len(found) - 1)
        return devices, options.n_gpu_layers, weights

    # --- text -------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos and self._add_bos, special)

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self._piece(t) for t in tokens)

    def _piece(self, token: int) -> bytes:
        # llama-cpp-python's detokenize uses a 32-byte buffer and silently drops longer pieces
        # (SmolLM2 has 47, e.g. runs of spaces); ask for the size llama.cpp says it needs.
        piece = self._pieces.get(token)
        if piece is None:
            import llama_cpp

            vocab = self._llm._model.vocab
            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, False)
                if n >= 0:
                    break
                size = -n
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    # --- compute ------------------------------------------------------------------------
    def _forward_seq(
        self, seq_id: int, n_past: int, tokens: list[int], all_logits: bool, copy: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One sequence's tokens in chunks of n_batch: its logits (and features) rows."""
        features = self.options.features
        if self._row_rule:
            rows = len(tokens) if all_logits else 1
            if all_logits:
                at, rest, last = n_past, tokens, None
            else:
                at, rest, last = self._prompt_blocks(seq_id, n_past, tokens)
            if not rest:  # the prompt ended on a whole block: its pass gave the last logits
                # (and no features: in embeddings mode the block's last layer would run on
                # all 8 rows, other kernels than the one row it gives the logits)
                assert last is not None
                return (last.copy() if copy else last), None
            outs, feats = self._forward_rows([(seq_id, at, rest, rows)], copy, features)
            return outs[0], feats[0]
        ctx = self._llm._ctx
        rows, feats = [], []
        starts = list(range(0, len(tokens), self._n_batch))
        if features and not all_logits and len(tokens) - starts[-1] > 1:
            # Prefill: the last token alone in a batch of its own. In embeddings mode llama.cpp
            # outputs every token of a batch, and the rest of the prompt's last chunk would
            # pay logits (and output buffer: rows x vocabulary floats) for nothing; kernels
            # that are batch-invariant give that token the same bits either way.
            starts.append(len(tokens) - 1)
        try:
            for j, i in enumerate(starts):
                chunk = tokens[i : starts[j + 1] if j + 1 < len(starts) else i + self._n_batch]
                last_chunk = j + 1 == len(starts)
                wanted = all_logits or last_chunk
                # Embeddings mode outputs every token of a batch (llama.cpp overrides the
                # batch's flags, and logs that it did): ask for them all.
                every_row = all_logits or (features and wanted)
                if features:
                    self._set_embeddings(wanted)
                n_rows = len(chunk) if every_row else 1  # llama.cpp: at least one output
                self._fill_batch([(seq_id, n_past + i, chunk, n_rows)])
                t = time.perf_counter()
                ctx.decode(self._llm._batch)
                self.decode_s += time.perf_counter() - t
                if wanted:
                    out = np.ctypeslib.as_array(ctx.get_logits(), shape=(n_rows, self.n_vocab))
                    if not all_logits:
                        out = out[-1:]
                    # The next decode overwrites the buffer: only the last chunk may stay a view.
                    rows.append(out if last_chunk and not copy else out.copy())
                    if features:
                        emb = np.ctypeslib.as_array(
                            ctx.get_embeddings(), shape=(n_rows, self.n_embd)
                        )
                        feats.append((emb if all_logits else emb[-1:]).copy())
        except Exception:
            ctx.kv_cache_seq_rm(seq_id, n_past, -1)  # leave the cache as the slot's tokens say
            raise
        out_features = None
        if features:
            out_features = feats[0] if len(feats) == 1 else np.concatenate(feats)
            out_features.flags.writeable = False
        if len(rows) > 1:
            return np.concatenate(rows), out_features
        rows[0].flags.writeable = copy  # a view of llama.cpp's buffer is read-only
        return rows[0], out_features

    def _prompt_blocks(
        self, seq_id: int, n_past: int, tokens: list[int]
    ) -> tuple[int, list[int], np.ndarray | None]:
        """A prompt pass's whole blocks under the row rule: from prompt_pass_start (cached
        positions whose kernels a cold pass would not have given them are computed again) to
        the last multiple of BLOCK_ROWS, in n_batch chunks of whole blocks. Returns where the
        rest starts and its tokens, to go as generation rows, and the last block's logits row
        (a read-only view of llama.cpp's buffer) when a block was run."""
        end = n_past + len(tokens)
        body = end - end % BLOCK_ROWS
        start = prompt_pass_start(n_past, end, self._block_prefix[seq_id])
        held = self._slots[seq_id].tokens  # the sequence's cached tokens (n_past of them)
        if start < n_past:
            self._truncate_seq(seq_id, start)
            tokens = [*held[start:n_past], *tokens]
        ctx = self._llm._ctx
        step = max(BLOCK_ROWS, self._n_batch - self._n_batch % BLOCK_ROWS)
        out: np.ndarray | None = None
        if self.options.features:  # embeddings mode would output (and pay for) every row
            self._set_embeddings(False)
        for i in range(start, body, step):
            chunk = tokens[i - start : min(i + step, body) - start]
            self._fill_batch([(seq_id, i, chunk, 1)])
            t = time.perf_counter()
            try:
                ctx.decode(self._llm._batch)
            except Exception:
                self._truncate_seq(seq_id, i)
                del held[min(i, n_past) :]  # the sequence's tokens: what its cache holds
                raise
            self.decode_s += time.perf_counter() - t
            self._block_prefix[seq_id] = i + len(chunk)
            out = np.ctypeslib.as_array(ctx.get_logits(), shape=(1, self.n_vocab))
            out.flags.writeable = False
        first_row = max(start, body)
        return first_row, tokens[first_row - start :], out

    def _forward_rows(
        self, entries: list[tuple[int, int, list[int], int]], copy: bool, features: bool = False
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """(seq_id, n_past, tokens, rows) entries as generation rows under the row rule: in
        passes of at most `_row_pass` rows (one-row kernels, as a single-token decode), packed
        across entries. Each entry's last `rows` logits, and their features if `features`
        (embeddings mode then outputs every row of a pass: below the kernels' floors each row
        runs the one-row kernels however many a pass outputs, so the logits keep their bits)."""
        rows = [
            (seq, past + i, tok, i >= len(toks) - n)
            for seq, past, toks, n in entries
            for i, tok in enumerate(toks)
        ]
        per_pass = self._row_pass
        ctx = self._llm._ctx
        lone = len(rows) <= per_pass and not copy and not features  # one pass, read in place
        outs: list[np.ndarray] = []
        embs: list[np.ndarray] = []
        for at in range(0, len(rows), per_pass):
            part = rows[at : at + per_pass]
            wanted = [want for *_, want in part]
            if self.options.features:
                self._set_embeddings(features and any(wanted))
            if self._embeddings_on:
                asked = [True] * len(part)
            else:  # llama.cpp outputs a row at least: a pass of prompt rows, its last
                asked = wanted if any(wanted) else [False] * (len(part) - 1) + [True]
            n_out = self._fill_batch(
                [(row[0], row[1], [row[2]], int(a)) for row, a in zip(part, asked, strict=True)]
            )
            t = time.perf_counter()
            try:
                ctx.decode(self._llm._batch)
            except Exception:
                for seq, past, _, _ in entries:
                    self._truncate_seq(seq, past)
                    del self._slots[seq].tokens[past:]  # prompt rows computed again, if any
                raise
            self.decode_s += time.perf_counter() - t
            if any(wanted):
                out = np.ctypeslib.as_array(ctx.get_logits(), shape=(n_out, self.n_vocab))
                if self._embeddings_on:  # every row out: the wanted ones (copies)
                    emb = np.ctypeslib.as_array(ctx.get_embeddings(), shape=(n_out, self.n_embd))
                    embs.append(emb[wanted])
                    outs.append(out[wanted])
                else:  # the next pass overwrites the buffer: only a lone pass may stay a view
                    outs.append(out if lone else out.copy())
        if not outs:
            logits = np.zeros((0, self.n_vocab), dtype=np.float32)
        else:
            logits = outs[0] if len(outs) == 1 else np.concatenate(outs)
        logits.flags.writeable = not lone  # a view of llama.cpp's buffer is read-only
        feats = np.concatenate(embs) if embs else None  # rows only a features pass keeps
        if feats is not None:
            feats.flags.writeable = False
        result: list[np.ndarray] = []
        result_feats: list[np.ndarray | None] = []
        at = 0
        for *_, n in entries:
            result.append(logits[at : at + n])
            result_feats.append(feats[at : at + n] if feats is not None and n else None)
            at += n
        return result, result_feats

    def _forward_many(
        self, entries: list[tuple[int, int, list[int], int]]
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        # Features only for a pass of one sequence: embeddings mode outputs (and buffers
        # logits for) every token of a pass, which for a batch with prompt chunks in it cost
        # more than the head they serve could win (measured: 8 streams at 36 tokens/s with
        # features on against 81 off). A head then has no feature after a batched pass and
        # proposes nothing (output unchanged) until its sequence runs alone again.
        features = self.options.features and len(entries) == 1 and entries[0][3] > 0
        if self._row_rule:
            # An entry's tokens without logits are prompt (whole blocks in passes of their own
            # each), the rest generation rows (a prompt's last partial block, verified tokens).
            try:
                gen = []
                for seq, past, tokens, rows in entries:
                    at, rest = past, tokens
                    if len(tokens) > rows:
                        at, rest, _ = self._prompt_blocks(seq, past, tokens[: len(tokens) - rows])
                        rest = [*rest, *tokens[len(tokens) - rows :]]
                    gen.append((seq, at, rest, rows))
                outs, feats = self._forward_rows([g for g in gen if g[2]], False, features)
            except Exception:  # no entry's tokens are added: neither is its cache
                for seq, past, _, _ in entries:
                    self._truncate_seq(seq, min(past, len(self._slots[seq].tokens)))
                raise
            empty = np.zeros((0, self.n_vocab), dtype=np.float32)
            got = iter(zip(outs, feats, strict=True))
            pairs = [next(got) if g[2] else (empty, None) for g in gen]
            return [o for o, _ in pairs], [f for _, f in pairs]
        total = sum(len(tokens) for _, _, tokens, _ in entries)
        if total > self._n_batch:
            raise ValueError(f"a batch of {total} tokens exceeds n_batch {self._n_batch}")
        ctx = self._llm._ctx
        if self.options.features:
            self._set_embeddings(features)
        if features:  # embeddings mode outputs every token (see _forward_seq)
            entries_out = [(seq, past, tokens, len(tokens)) for seq, past, tokens, _ in entries]
        else:
            entries_out = entries
        n_out = self._fill_batch(entries_out)
        t = time.perf_counter()
        try:
            ctx.decode(self._llm._batch)
        except Exception:
            for seq_id, n_past, _, _ in entries:
                ctx.kv_cache_seq_rm(seq_id, n_past, -1)
            raise
        self.decode_s += time.perf_counter() - t
        if n_out:
            logits = np.ctypeslib.as_array(ctx.get_logits(), shape=(n_out, self.n_vocab))
            logits.flags.writeable = False
        else:
            logits = np.zeros((0, self.n_vocab), dtype=np.float32)
        emb = None
        if features:
            emb = np.ctypeslib.as_array(ctx.get_embeddings(), shape=(n_out, self.n_embd)).copy()
            emb.flags.writeable = False
        outs: list[np.ndarray] = []
        feats: list[np.ndarray | None] = []
        at = 0
        for (*_, rows), (*_, out_rows) in zip(entries, entries_out, strict=True):
            skip = out_rows - rows  # rows output only because embeddings mode outputs all
            outs.append(logits[at + skip : at + out_rows])
            feats.append(emb[at + skip : at + out_rows] if emb is not None and rows else None)
            at += out_rows
        return outs, feats

    def _fill_batch(self, entries: list[tuple[int, int, list[int], int]]) -> int:
        """Write (seq_id, n_past, tokens, rows) entries into the batch, asking for logits of
        each entry's last `rows` tokens. Returns the number of rows asked for."""
        b = self._llm._batch.batch
        n = n_out = 0
        for seq_id, n_past, tokens, rows in entries:
            first_out = len(tokens) - rows
            for i, tok in enumerate(tokens):
                b.token[n] = tok
                b.pos[n] = n_past + i
                b.seq_id[n][0] = seq_id
                b.n_seq_id[n] = 1
                b.logits[n] = i >= first_out
                n += 1
            n_out += rows
        b.n_tokens = n
        return n_out

    def _set_embeddings(self, on: bool) -> None:
        """Embeddings mode on only for the batches whose rows are returned: in it llama.cpp
        outputs (and pays logits for) every token, which the rest of a prompt need not."""
        if on != self._embeddings_on:
            import llama_cpp

            llama_cpp.llama_set_embeddings(self._llm._ctx.ctx, on)
            self._embeddings_on = on

    def _truncate_seq(self, seq_id: int, n: int) -> None:
        self._block_prefix[seq_id] = min(self._block_prefix[seq_id], n)
        if not self._llm._ctx.kv_cache_seq_rm(seq_id, n, -1):
            raise RuntimeError(f"llama.cpp refused to truncate sequence {seq_id} to {n}")

    def _reusable_seq(self, seq_id: int, n: int, end: int) -> int:
        if self._row_rule:
            n = prompt_pass_start(n, end, min(self._block_prefix[seq_id], n))
        return n if self._window_held(seq_id, n) else 0

    def _window_held(self, seq_id: int, n: int) -> bool:
        """Whether a pass from position n finds what its sliding-window layers attend to: a
        window-sized cache overwrites cells once they fall out of the window of the newest
        token, so a prefix cut deeper than that must be computed again (llama-server's test)."""
        if not self._n_swa or n == 0:
            return True
        import llama_cpp

        memory = llama_cpp.llama_get_memory(self._llm._ctx.ctx)
        return llama_cpp.llama_memory_seq_pos_min(memory, seq_id) <= max(0, n - self._n_swa)

    def _snapshot_seq(self, seq_id: int, tokens: list[int]) -> KVSnapshot | None:
        import llama_cpp

        if not tokens or self._llm is None:
            return None
        ctx = self._llm._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)
        if n == 0 or n > size:
            return None
        return KVSnapshot(
            tokens=tuple(tokens),
            data=ctypes.string_at(buf, n),
            block_prefix=min(self._block_prefix[seq_id], len(tokens)),
        )

    def _restore_seq(self, seq_id: int, snapshot: KVSnapshot) -> bool:
        """Load a snapshot (of any slot of this context) into sequence `seq_id`."""
        import llama_cpp

        if self._llm is None or len(snapshot.tokens) > self.n_ctx:
            return False
        src = (ctypes.c_uint8 * len(snapshot.data)).from_buffer_copy(snapshot.data)
        if llama_cpp.llama_state_seq_set_data(self._llm._ctx.ctx, src, len(src), seq_id) == 0:
            self._truncate_seq(seq_id, 0)  # a failed load leaves it unknown
            return False
        self._block_prefix[seq_id] = snapshot.block_prefix
        return True

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None
        self.tokens = []

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "n_threads": self.n_threads,
            "n_gpu_layers": self.options.n_gpu_layers,
            **({"n_seq": self.options.n_seq} if self.options.n_seq > 1 else {}),
            **({"rpc": list(self.options.rpc)} if self.options.rpc else {}),
            # Offloaded layers run GPU kernels, whose invariance this does not establish; RPC
            # workers (memspec rpc-worker, set up from the same build) run the CPU's.
            "weight_repack": self.repacked,
            "tiled_matmul": self.tiled,
            "batch_invariant": batch_invariant()
            and (self.options.n_gpu_layers == 0 or bool(self.options.rpc))
            and (self._row_rule or not (self.repacked or self.tiled)),
        }

    def kv_layout(self) -> tuple[object, ...] | None:
        if self.options.rpc:  # a snapshot would read every layer's cache over the links
            return None
        arch = self.metadata.get("general.architecture", "llama")
        return llama_kv_layout(
            arch,
            self.n_layers,
            self.n_kv_heads,
            self.head_dim_k,
            self.head_dim_v,
            self.options.kv_cache,
        )

    # --- memory -------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        # K and V as the cache types store them, over a slot's cells: sliding-window layers
        # hold the window only (KVCache.bytes_at), so a token costs less at a long context.
        arch = self.metadata.get("general.architecture", "llama")
        n_swa, swa_layers = sliding_window(
            arch, self.n_layers, int(self.metadata.get(f"{arch}.attention.sliding_window", 0)),
            self.metadata.get(f"{arch}.attention.sliding_window_pattern"),
        )  # fmt: skip
        total = self.options.kv_cache.bytes_at(
            self.n_ctx, self.n_layers, self.n_kv_heads, self.head_dim_k, self.head_dim_v,
            n_swa, swa_layers, min(self._n_batch, 512),
        )  # fmt: skip
        return total // max(self.n_ctx, 1)


def _end_of_generation_ids(vocab: object, n_vocab: int) -> frozenset[int]:
    """Every id llama.cpp ends a generation on (`llama_vocab_is_eog`): EOS and EOT, and what
    it auto-detects from the vocabulary, e.g. Qwen's `<|endoftext|>` beside `<|im_end|>`, and
    its FIM pad/repo/file-separator tokens (one call per id: ~0.1 s for 150k at load)."""
    import llama_cpp

    return frozenset(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
