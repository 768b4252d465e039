"""ggml RPC workers for tests (memspec/rpc/local.py: loopback subprocesses behind latency
relays; this kernel has no `tc netem`, so the link's latency comes from the relay)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from memspec.rpc.local import LocalWorker, local_workers


def require_rpc() -> None:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-rpc.so"
    if not lib.is_file():
        pytest.fail("llama-cpp-python was built without GGML_RPC: rerun scripts/setup.sh")


@contextlib.contextmanager
def workers(tmp: Path, n: int = 2, delay_s: float = 0.0) -> Iterator[list[LocalWorker]]:
    require_rpc()
    with local_workers(tmp, n, delay_s) as ws:
        yield ws
