"""llama-cpp-python backend: batched decode with per-position logits, KV truncation by seq_rm.

We drive llama.cpp's context directly (one sequence, our own batches) and use `Llama` only to
load the model, its tokenizer and its metadata. Logits are requested per token in the batch,
so a prefill pays for one row and a verification for k+1.

Lossless needs batch invariance: a position's logits must not depend on how many tokens share
its batch, or a verification of k+1 tokens can flip a near-tie that single-token decoding
resolves the other way. llama.cpp's CPU matmuls are invariant (one dot product per output, the
same order for any batch) except three paths that sum in another order for a batch than for
one row, all kept out of a target:
- llamafile's sgemm, which `scripts/setup.sh` builds out (`-DGGML_LLAMAFILE=OFF`);
- the tiled K-quant matmul (Q3_K..Q6_K, taken from 8 rows on), off through its switch
  `GGML_CPU_TILED_MM=0`, which importing memspec sets before the library first reads it;
- weight repacking (Q4_0, Q4_K, IQ4_NL...): a matmul over a batch runs its rows in groups of
  4 through a gemm kernel and the rest (fewer than 4) through gemv, which sum in another order
  (logits differ by up to ~0.7 on Qwen2.5-Coder 1.5B Q4_K_M). A target keeps the repack's
  speed with the *row rule* (BackendOptions.batch_invariant), which gives every position the
  kernel a cold plain decoding gives it: a prompt pass of positions [start, end) computes
  [0, end - end % 4) through gemm in groups aligned at position 0 and the rest through gemv
  (`prompt_pass_start` says what must be computed again for that); generation passes go in
  passes of at most 3 rows, all gemv. Each sequence keeps how far its gemm prefix reaches.
`batch_invariant()` says whether this process has the first two off.

Features (BackendOptions.features): the final hidden state of each returned row, read from
llama.cpp's embeddings mode (its `t_embd`, the output layer's input), on only for the batches
whose rows are returned. The graph is the same with it on, so logits keep their bits.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
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
    """Whether llama.cpp's CPU kernels give a position the same logits in any batch shape
    (for a model loaded without weight repacking)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return "LLAMAFILE = 1" not in info and os.environ.get("GGML_CPU_TILED_MM") == "0"


# llama.cpp's repacked matmul runs a batch's rows in groups of GEMM_ROWS through its gemm
# kernel and the remainder through gemv (ggml-cpu/repack.cpp, forward_mul_mat_one_chunk).
GEMM_ROWS = 4


def prompt_pass_start(n_past: int, end: int, gemm_prefix: int) -> int:
    """Where a prompt pass that extends a sequence of `n_past` cached positions to `end` must
    start so that every position gets the kernel a cold pass over [0, end) gives it: gemm
    below `body` = end rounded down to GEMM_ROWS, in groups aligned at 0; gemv from there.
    `gemm_prefix`: how many leading cached positions gemm computed (the rest, gemv)."""
    body = end - end % GEMM_ROWS
    start = n_past
    if gemm_prefix < min(n_past, body):  # cached positions gemv computed that need gemm
        start = gemm_prefix
    if n_past > body and gemm_prefix > body:  # cached positions gemm computed that need gemv
        start = min(start, body)
    if start < body:  # llama.cpp groups rows from the pass's first one
        start -= start % GEMM_ROWS
    return start


def _repacked(load_log: str) -> bool:
    """Whether llama.cpp put any weights in its repacked buffer (its load log names it)."""
    return "CPU_REPACK model buffer size" in load_log


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
                # verbose: the load log (in buf) says whether any weights were repacked.
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
                    verbose=options.weight_repack,
                    **extra,
                )
                if options.weight_repack:
                    from llama_cpp._logger import set_verbose

                    set_verbose(False)  # llama.cpp's later logs stay quiet
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
        self.repacked = bool(shared.notes.get("repacked", False))
        self.shares_weights = not shared.fresh
        # The row rule (module docstring): only where repacked weights make the batch matter.
        self._row_rule = self.repacked and options.batch_invariant and not options.features
        self._gemm_prefix = [0] * n_seq  # per sequence: positions gemm computed
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
        if self._row_rule:
            if all_logits:
                return self._forward_rows([(seq_id, n_past, tokens)], copy)[0], None
            return self._forward_prompt(seq_id, n_past, tokens, copy), None
        ctx = self._llm._ctx
        features = self.options.features
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

    def _forward_prompt(
        self, seq_id: int, n_past: int, tokens: list[int], copy: bool
    ) -> np.ndarray:
        """A prompt pass under the row rule: computed again from prompt_pass_start (cached
        positions whose kernel a cold pass would not have given them), in n_batch chunks (a
        multiple of GEMM_ROWS, so the groups stay aligned). The last position's logits."""
        end = n_past + len(tokens)
        start = prompt_pass_start(n_past, end, self._gemm_prefix[seq_id])
        held = self._slots[seq_id].tokens  # the sequence's cached tokens (n_past of them)
        if start < n_past:
            self._truncate_seq(seq_id, start)
            tokens = [*held[start:n_past], *tokens]
        ctx = self._llm._ctx
        out: np.ndarray | None = None
        for i in range(start, end, self._n_batch):
            chunk = tokens[i - start : i - start + self._n_batch]
            self._fill_batch([(seq_id, i, chunk, 1)])
            t = time.perf_counter()
            try:
                ctx.decode(self._llm._batch)
            except Exception:
                self._truncate_seq(seq_id, i)
                del held[min(i, n_past) :]  # the sequence's tokens: what its cache holds
                raise
            self.decode_s += time.perf_counter() - t
            self._gemm_prefix[seq_id] = min(end - end % GEMM_ROWS, i + len(chunk))
            out = np.ctypeslib.as_array(ctx.get_logits(), shape=(1, self.n_vocab))
        assert out is not None
        if copy:
            return out.copy()
        out.flags.writeable = False
        return out

    def _forward_rows(
        self, entries: list[tuple[int, int, list[int]]], copy: bool
    ) -> list[np.ndarray]:
        """Generation rows under the row rule: every row's logits, in passes of fewer than
        GEMM_ROWS rows (all gemv, as a single-token decode), packed across entries."""
        rows = [(seq, past + i, tok) for seq, past, toks in entries for i, tok in enumerate(toks)]
        per_pass = GEMM_ROWS - 1
        ctx = self._llm._ctx
        lone = len(rows) <= per_pass and not copy  # one pass, read in place
        outs: list[np.ndarray] = []
        for at in range(0, len(rows), per_pass):
            part = rows[at : at + per_pass]
            self._fill_batch([(seq, pos, [tok], 1) for seq, pos, tok in part])
            t = time.perf_counter()
            try:
                ctx.decode(self._llm._batch)
            except Exception:
                for seq, past, _ in entries:
                    self._truncate_seq(seq, past)
                raise
            self.decode_s += time.perf_counter() - t
            out = np.ctypeslib.as_array(ctx.get_logits(), shape=(len(part), self.n_vocab))
            # The next pass overwrites the buffer: only a lone pass may stay a view.
            outs.append(out if lone else out.copy())
        logits = outs[0] if len(outs) == 1 else np.concatenate(outs)
        logits.flags.writeable = not lone  # a view of llama.cpp's buffer is read-only
        result, at = [], 0
        for _, _, toks in entries:
            result.append(logits[at : at + len(toks)])
            at += len(toks)
        return result

    def _forward_many(
        self, entries: list[tuple[int, int, list[int], int]]
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        if self._row_rule:
            # An entry's tokens without logits are prompt (a pass of its own each), those
            # with logits generation rows (verified, or a prompt's last token): in that order.
            try:
                for seq, past, tokens, rows in entries:
                    if len(tokens) > rows:
                        self._forward_prompt(seq, past, tokens[: len(tokens) - rows], copy=False)
                gen = [
                    (seq, past + len(tokens) - rows, tokens[len(tokens) - rows :])
                    for seq, past, tokens, rows in entries
                    if rows
                ]
                outs = iter(self._forward_rows(gen, copy=False) if gen else [])
            except Exception:  # no entry's tokens are added: neither is its cache
                for seq, past, _, _ in entries:
                    self._truncate_seq(seq, min(past, len(self._slots[seq].tokens)))
                raise
            empty = np.zeros((0, self.n_vocab), dtype=np.float32)
            return [next(outs) if rows else empty for *_, rows in entries], [None] * len(entries)
        total = sum(len(tokens) for _, _, tokens, _ in entries)
        if total > self._n_batch:
            raise ValueError(f"a batch of {total} tokens exceeds n_batch {self._n_batch}")
        ctx = self._llm._ctx
        # Features only for a pass of one sequence: embeddings mode outputs (and buffers
        # logits for) every token of a pass, which for a batch with prompt chunks in it cost
        # more than the head they serve could win (measured: 8 streams at 36 tokens/s with
        # features on against 81 off). A head then has no feature after a batched pass and
        # proposes nothing (output unchanged) until its sequence runs alone again.
        features = self.options.features and len(entries) == 1 and entries[0][3] > 0
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
        self._gemm_prefix[seq_id] = min(self._gemm_prefix[seq_id], n)
        if not self._llm._ctx.kv_cache_seq_rm(seq_id, n, -1):
            raise RuntimeError(f"llama.cpp refused to truncate sequence {seq_id} to {n}")

    def _reusable_seq(self, seq_id: int, n: int, end: int) -> int:
        if self._row_rule:
            n = prompt_pass_start(n, end, min(self._gemm_prefix[seq_id], n))
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
            gemm_prefix=min(self._gemm_prefix[seq_id], len(tokens)),
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
        self._gemm_prefix[seq_id] = snapshot.gemm_prefix
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
            "batch_invariant": batch_invariant()
            and (self.options.n_gpu_layers == 0 or bool(self.options.rpc))
            and (not self.repacked or self._row_rule),
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
