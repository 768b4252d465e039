"""A llama.cpp target in a process of its own, for a target split over ggml RPC workers.

ggml's RPC client calls GGML_ABORT when it cannot reach or loses a worker, which ends the whole
process; a hung worker blocks its socket read forever. Run in the daemon's process, either
would take every other request down with it. So the model lives in a child process (spawned:
the parent has running threads) that serves the backend's primitive calls over a pipe: a call
that finds the child dead, or gets no answer within `rpc_timeout_s`, raises DeviceUnavailable,
and from then on every call does, until `restart()` brings a new child up once the workers
answer again. The parent keeps what the KV cache holds (`tokens`), as for any backend; the child
only runs the sequence-level primitives with explicit positions. Greedy decoding gets back one
argmax per row, not the rows."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from memspec.backends.base import (
    Backend,
    BackendOptions,
    KVSnapshot,
    SequenceContext,
    SequenceSlot,
    argmax_rows,
)
from memspec.errors import DeviceUnavailable

log = logging.getLogger("memspec.backends")

PR_SET_PDEATHSIG = 1
LOAD_TIMEOUT_S = 600.0  # a first load sends every remote layer's weights over the link
# What the parent copies from the child's backend once it has loaded.
_INFO = (
    "n_ctx", "n_vocab", "n_embd", "bos_token_id", "eos_token_ids", "metadata", "max_batch",
    "_bos_text", "_eos_text", "_add_bos", "n_layers", "n_kv_heads", "head_dim_k", "head_dim_v",
)  # fmt: skip


def _serve(conn: Connection, path: str, options: BackendOptions) -> None:
    """The child: load the backend, then answer (method, args) calls until told to close."""
    # A lost worker ends this process in GGML_ABORT: its one-line reason is what matters,
    # not the backtrace ggml would otherwise attach a debugger for (seconds, pages of output).
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    # The daemon decides when this process ends: a Ctrl-C or SIGTERM to the daemon's group
    # must not cut a generation the daemon is letting finish; and it dies with the daemon.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    from memspec.backends.llama_cpp import LlamaCppBackend

    try:
        backend = LlamaCppBackend(Path(path), options)
    except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
        _send_error(conn, e)
        return
    info = {k: getattr(backend, k) for k in _INFO}
    info["describe"] = backend.describe()
    info["kv_bytes_per_token"] = backend.kv_bytes_per_token()
    conn.send(("ok", info))
    while True:
        try:
            name, args = conn.recv()
        except EOFError:  # the parent went away
            break
        if name == "close":
            break
        try:
            if name == "argmax_seq":  # one greedy pass: only the argmaxes travel back
                seq_id, n_past, tokens, drafted = args
                rows, feats = backend._forward_seq(seq_id, n_past, tokens, True, False)
                result: Any = (argmax_rows(rows, drafted), feats)
            else:
                result = getattr(backend, name)(*args)
            # With the time its forward passes have taken so far (the parent's decode_s).
            conn.send(("ok", (result, backend.decode_s)))
        except Exception as e:  # noqa: BLE001 - the parent raises it in the request
            _send_error(conn, e)
    backend.close()


def _send_error(conn: Connection, e: Exception) -> None:
    """Send `e` to the parent; one that cannot be pickled goes as its text."""
    try:
        conn.send(("error", e))
    except Exception:  # noqa: BLE001
        conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the daemon's thread that spawned it dies (a daemon
    killed outright must not leave a target holding its memory and its workers)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class IsolatedBackend(SequenceContext):
    def __init__(self, path: Path, options: BackendOptions):
        super().__init__()
        self.path, self.options = path, options
        self.lost: str | None = None  # why the child is gone (every call raises it)
        self.on_wait: Callable[[], None] | None = None  # called each second of a long wait
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._pieces: dict[int, bytes] = {}
        self._start()
        n_seq = max(1, options.n_seq)
        self._slots: list[Backend] = [self] + [SequenceSlot(self, i) for i in range(1, n_seq)]

    # --- the child ----------------------------------------------------------------------
    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_serve, args=(child, str(self.path), self.options), name="memspec-target"
        )
        proc.daemon = True
        proc.start()
        child.close()
        self._proc, self._conn, self.lost = proc, parent, None
        self._decode_base = self.decode_s  # what earlier children's passes took
        status, value = self._receive(LOAD_TIMEOUT_S, "loading the target")
        if status == "error":
            self._stop()
            self.lost = str(getattr(value, "message", value))
            raise value
        for k in _INFO:
            setattr(self, k, value[k])
        self._describe = value["describe"]
        self._kv_bytes = value["kv_bytes_per_token"]

    def _receive(self, timeout_s: float, doing: str) -> tuple[str, Any]:
        assert self._conn is not None and self._proc is not None
        deadline = time.monotonic() + timeout_s
        try:
            # In slices, beating: a long load is not a stuck engine to the systemd watchdog.
            while not self._conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    self._lose(f"no answer from the target's process after {timeout_s:.0f} s "
                               f"{doing} (a stalled link or a hung rpc worker)")  # fmt: skip
                if self.on_wait is not None:
                    self.on_wait()
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(1.0)
            self._lose(
                f"the target's process ended (exit {self._proc.exitcode}) {doing}: an rpc "
                f"worker ({', '.join(self.options.rpc)}) was lost or refused it"
            )

    def _lose(self, why: str) -> None:
        self.lost = why
        self._stop()
        log.error("%s", why)
        raise DeviceUnavailable(why)

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)

    def _call(self, name: str, *args: Any) -> Any:
        if self.lost is not None:
            raise DeviceUnavailable(self.lost)
        assert self._conn is not None
        try:
            self._conn.send((name, args))
        except OSError:
            pass  # the child is gone: _receive says why
        # rpc_timeout_s bounds one pass: a prompt goes in passes of max_batch tokens.
        passes = max(1, -(-self._tokens_in(name, args) // max(1, self.max_batch)))
        status, value = self._receive(self.options.rpc_timeout_s * passes, f"running {name}")
        if status == "error":
            raise value
        result, child_decode_s = value
        self.decode_s = self._decode_base + child_decode_s
        return result

    @staticmethod
    def _tokens_in(name: str, args: tuple) -> int:
        if name in ("_forward_seq", "argmax_seq"):
            return len(args[2])
        if name == "_forward_many":
            return sum(len(tokens) for _, _, tokens, _ in args[0])
        return 0

    def restart(self) -> None:
        """A new child, once every worker answers (DeviceUnavailable while one does not);
        every slot starts empty."""
        from memspec.rpc.endpoints import check_reachable

        for endpoint in self.options.rpc:
            check_reachable(endpoint)
        self._stop()
        self._start()
        for slot in self._slots:
            slot.tokens = []
            slot._features = None

    # --- text -----------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._call("tokenize", text, add_bos, special)

    def detokenize(self, tokens: list[int]) -> bytes:
        for t in {t for t in tokens if t not in self._pieces}:
            self._pieces[t] = self._call("_piece", t)
        return b"".join(self._pieces[t] for t in tokens)

    # --- compute --------------------------------------------------------------------------
    def _forward_argmax(self, tokens: list[int], drafted: list[int] | None = None) -> list[int]:
        ids, self._features = self._call("argmax_seq", 0, len(self.tokens), tokens, drafted)
        return ids

    def _forward_seq(
        self, seq_id: int, n_past: int, tokens: list[int], all_logits: bool, copy: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        return self._call("_forward_seq", seq_id, n_past, tokens, all_logits, True)

    def _forward_many(
        self, entries: list[tuple[int, int, list[int], int]]
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        return self._call("_forward_many", entries)

    def _truncate_seq(self, seq_id: int, n: int) -> None:
        if self.lost is None:  # a lost child's KV is gone whole: nothing to truncate
            self._call("_truncate_seq", seq_id, n)

    def _snapshot_seq(self, seq_id: int, tokens: list[int]) -> KVSnapshot | None:
        return self._call("_snapshot_seq", seq_id, list(tokens)) if tokens else None

    def _restore_seq(self, seq_id: int, snapshot: KVSnapshot) -> bool:
        return bool(self._call("_restore_seq", seq_id, snapshot))

    def close(self) -> None:
        if self._conn is not None and self.lost is None:
            try:
                self._conn.send(("close", ()))
                if self._proc is not None:
                    self._proc.join(10.0)
            except OSError:
                pass
        self._stop()
        self.tokens = []

    def describe(self) -> dict[str, object]:
        return {**self._describe, "isolated": True}

    def process_bytes(self) -> int:
        """The target's process's own memory (USS, else RSS): the daemon's measured use
        counts it, since the model lives there."""
        import psutil

        if self._proc is None or self._proc.pid is None or not self._proc.is_alive():
            return 0
        try:
            proc = psutil.Process(self._proc.pid)
            try:
                return proc.memory_full_info().uss
            except (psutil.Error, OSError):
                return proc.memory_info().rss
        except (psutil.Error, OSError):
            return 0

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes
