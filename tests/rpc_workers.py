"""ggml RPC workers for tests (memspec_lab/rpc_local.py): `memspec rpc-worker` subprocesses in
network namespaces of their own over veth pairs where this machine allows, else on loopback
(a warning in the test report says so), behind relays that add the link's latency (this
kernel has no `tc netem`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from memspec_lab.rpc_local import NETNS, LocalWorker, local_workers


def require_rpc() -> None:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-rpc.so"
    if not lib.is_file():
        pytest.fail("llama-cpp-python was built without GGML_RPC: rerun scripts/setup.sh")


@contextlib.contextmanager
def workers(tmp: Path, n: int = 2, delay_s: float = 0.0) -> Iterator[list[LocalWorker]]:
    require_rpc()
    with local_workers(tmp, n, delay_s) as (ws, link):
        if link != NETNS:
            warnings.warn(f"rpc workers on {link}", stacklevel=3)
        yield ws
